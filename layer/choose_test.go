package layer

import (
	"errors"
	"github.com/skiffnet/skiff/api"
	"slices"
	"testing"
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
	if !slices.Equal(choices, want) {
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
