package layer_test

import (
	"slices"
	"strings"
	"testing"

	_ "github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
	_ "github.com/skiffnet/skiff/sockets"
)

func TestLookup(t *testing.T) {
	regs, err := layer.Lookup([]string{"sockets", "cache"})
	if err != nil {
		t.Fatal(err)
	}
	if len(regs) != 2 || regs[0].Name != "sockets" || regs[1].Name != "cache" {
		t.Fatalf("Lookup(sockets, cache) = %v, want both in that order", regs)
	}
	if !regs[0].Needs.Listeners || regs[0].Needs.Endpoints || !regs[1].Needs.Endpoints || regs[1].Needs.Listeners {
		t.Errorf("needs: sockets %+v, cache %+v; want listeners and every endpoint", regs[0].Needs, regs[1].Needs)
	}
	for _, tc := range []struct {
		names []string
		want  string
	}{
		{[]string{"warp"}, `unknown layer "warp" (layers: cache, sockets)`},
		{[]string{"cache", "Cache"}, `unknown layer "Cache"`},
		{[]string{"cache", "cache"}, `layer "cache" named twice`},
		{[]string{""}, `unknown layer ""`},
	} {
		if _, err := layer.Lookup(tc.names); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Lookup(%q) = %v, want an error with %q", tc.names, err, tc.want)
		}
	}
}

func TestForMode(t *testing.T) {
	want := map[string][]string{"overlay": nil, "cache": {"cache"}, "sockets": {"sockets"}}
	for _, mode := range cluster.Modes {
		names, err := layer.ForMode(mode)
		if err != nil {
			t.Fatalf("mode %s: %v", mode, err)
		}
		if !slices.Equal(names, want[mode]) {
			t.Errorf("mode %s runs %v, want %v", mode, names, want[mode])
		}
		if _, err := layer.Lookup(names); err != nil {
			t.Errorf("mode %s: %v", mode, err)
		}
	}
	if len(want) != len(cluster.Modes) {
		t.Errorf("modes %v, want %d", cluster.Modes, len(want))
	}
	for _, mode := range []string{"", "auto", "Cache", "cache,sockets"} {
		if _, err := layer.ForMode(mode); err == nil || !strings.Contains(err.Error(), "is not one of [overlay cache sockets]") {
			t.Errorf("ForMode(%q) = %v, want an error naming the modes", mode, err)
		}
	}
}

// TestNewOptions: a layer refuses options of another's type.
func TestNewOptions(t *testing.T) {
	regs, err := layer.Lookup([]string{"cache", "sockets"})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range regs {
		if _, err := r.New(42); err == nil || !strings.Contains(err.Error(), "not int") {
			t.Errorf("%s layer with options 42: %v, want an error", r.Name, err)
		}
	}
	if _, err := regs[0].New(nil); err != nil {
		t.Errorf("cache with default options: %v", err)
	}
}

func TestRegisterRefuses(t *testing.T) {
	for name, r := range map[string]layer.Registration{
		"duplicate": {Name: "cache", New: func(any) (layer.Layer, error) { return nil, nil },
			Teardown: func(layer.Env) (bool, error) { return false, nil }},
		"no teardown": {Name: "steering", New: func(any) (layer.Layer, error) { return nil, nil }},
		"no name":     {},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: registered", name)
				}
			}()
			layer.Register(r)
		}()
	}
	if _, err := layer.Lookup([]string{"steering"}); err == nil {
		t.Error("a refused registration is known")
	}
}
