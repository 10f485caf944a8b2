package layer

import (
	"errors"
	"reflect"
	"slices"
	"testing"

	"github.com/skiffnet/skiff/api"
)

// TestChooseProbes: auto turns off a layer whose probe fails, with the
// probe's answer, and runs the rest in order; a layer asked for by name
// must pass its probe. A probe gets its layer's options.
func TestChooseProbes(t *testing.T) {
	var probed []any
	reg := func(name string, err error) Registration {
		return Registration{Name: name, Probe: func(o any) error { probed = append(probed, o); return err }}
	}
	all := []Registration{reg("a", nil), reg("b", errors.New("cgroup v2 not mounted and cannot be mounted")), {Name: "c"}}
	run, choices, err := choose(all, Auto, nil, map[string]any{"a": 1, "b": 2})
	if err != nil {
		t.Fatal(err)
	}
	if len(run) != 2 || run[0].Name != "a" || run[1].Name != "c" {
		t.Errorf("auto runs %v, want a and c", run)
	}
	want := []api.Layer{{Name: "a", On: true}, {Name: "b", Reason: "cgroup v2 not mounted and cannot be mounted"}, {Name: "c", On: true}}
	if !reflect.DeepEqual(choices, want) {
		t.Errorf("choices %+v, want %+v", choices, want)
	}
	if !slices.Equal(probed, []any{1, 2}) {
		t.Errorf("probes got options %v, want 1 and 2", probed)
	}
	if _, _, err := choose(all, "", []string{"c", "b"}, nil); err == nil || err.Error() != "layer b cannot run on this host: cgroup v2 not mounted and cannot be mounted" {
		t.Errorf("asked for by name: %v", err)
	}
	if _, _, err := choose(all, "b", nil, nil); err == nil {
		t.Error("mode b ran without b's requirement")
	}
	probed = nil
	run, choices, err = choose(all, "", []string{"c", "a"}, nil)
	if err != nil || len(run) != 2 || run[0].Name != "c" || run[1].Name != "a" {
		t.Errorf("layers c,a: %v %v", run, err)
	}
	if choices[1].On || choices[1].Reason != "not in layers c,a" || len(probed) != 1 {
		t.Errorf("b not asked for: %+v, probes %v (want b not probed)", choices[1], probed)
	}
}

// TestChooseManual: auto leaves a manual layer off with its reason; named,
// it runs.
func TestChooseManual(t *testing.T) {
	all := []Registration{{Name: "a"}, {Name: "m", Manual: "runs only when named"}}
	run, choices, err := choose(all, Auto, nil, nil)
	if err != nil || len(run) != 1 || run[0].Name != "a" || choices[1].On || choices[1].Reason != "runs only when named" {
		t.Errorf("auto: runs %v (%v), choices %+v", run, err, choices)
	}
	if run, _, err := choose(all, "m", nil, nil); err != nil || len(run) != 1 || run[0].Name != "m" {
		t.Errorf("mode m: %v %v", run, err)
	}
}

// TestChooseWith: a layer that serves another (With, from its options)
// runs beside it only: off in auto when the other is off, an error when
// named without it; options that serve nothing let it run alone.
func TestChooseWith(t *testing.T) {
	with := func(o any) []string {
		if o == "alone" {
			return nil
		}
		return []string{"s"}
	}
	ch := Registration{Name: "ch", With: with}
	for _, tc := range []struct {
		sErr    error
		options map[string]any
		want    []string
		reason  string
	}{
		{nil, nil, []string{"ch", "s"}, ""},
		{errors.New("no broker"), nil, nil, "serves layer s, which is off"},
		{errors.New("no broker"), map[string]any{"ch": "alone"}, []string{"ch"}, ""},
	} {
		all := []Registration{ch, {Name: "s", Probe: func(any) error { return tc.sErr }}}
		run, choices, err := choose(all, Auto, nil, tc.options)
		var names []string
		for _, r := range run {
			names = append(names, r.Name)
		}
		if err != nil || !slices.Equal(names, tc.want) || choices[0].Reason != tc.reason {
			t.Errorf("s probe %v, options %v: runs %v (%v), choices %+v; want %v, reason %q", tc.sErr, tc.options, names, err, choices, tc.want, tc.reason)
		}
	}
	// A chain, the server first: a serves b, which serves c, which is off.
	chain := []Registration{
		{Name: "a", With: func(any) []string { return []string{"b"} }},
		{Name: "b", With: func(any) []string { return []string{"c"} }},
		{Name: "c", Probe: func(any) error { return errors.New("no") }},
	}
	if run, _, err := choose(chain, Auto, nil, nil); err != nil || len(run) != 0 {
		t.Errorf("chain a→b→c with c off: runs %v (%v), want none", run, err)
	}
	all := []Registration{ch, {Name: "s"}}
	if _, _, err := choose(all, "ch", nil, nil); err == nil || err.Error() != "layer ch serves layer s: run both (--layers)" {
		t.Errorf("mode ch without s: %v", err)
	}
	if run, _, err := choose(all, "", []string{"s", "ch"}, nil); err != nil || len(run) != 2 {
		t.Errorf("layers s,ch: %v %v", run, err)
	}
	if run, _, err := choose(all, "ch", nil, map[string]any{"ch": "alone"}); err != nil || len(run) != 1 {
		t.Errorf("mode ch alone: %v %v", run, err)
	}
}

// TestFirstStopsAtAFailure: checks after a failed one do not run (they
// may change the host).
func TestFirstStopsAtAFailure(t *testing.T) {
	ran := 0
	ok := func() error { ran++; return nil }
	fail := func() error { ran++; return errors.New("no TCX") }
	if err := First(ok, fail, ok); err == nil || err.Error() != "no TCX" || ran != 2 {
		t.Errorf("First = %v after %d checks, want the failure after 2", err, ran)
	}
	if err := First(ok, ok); err != nil {
		t.Errorf("First = %v", err)
	}
}
