package agent

import (
	"slices"
	"testing"

	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/layer"
)

// TestNewLayers: a mode's layers run, every other registered layer is torn
// down at start.
func TestNewLayers(t *testing.T) {
	for mode, want := range map[string]struct{ run, down []string }{
		"overlay": {nil, []string{"cache", "sockets"}},
		"cache":   {[]string{"cache"}, []string{"sockets"}},
	} {
		names, err := layer.ForMode(mode)
		if err != nil {
			t.Fatal(err)
		}
		layers, unwanted, err := newLayers(names, map[string]any{"cache": cache.Capacity{EgressIPs: 1, EgressHosts: 1, Ingress: 1, Filter: 1}})
		if err != nil {
			t.Fatalf("mode %s: %v", mode, err)
		}
		var run, down []string
		for _, l := range layers {
			run = append(run, l.name)
		}
		for _, r := range unwanted {
			down = append(down, r.Name)
		}
		if !slices.Equal(run, want.run) || !slices.Equal(down, want.down) {
			t.Errorf("mode %s runs %v and tears down %v, want %v and %v", mode, run, down, want.run, want.down)
		}
	}
	if _, _, err := newLayers([]string{"cache"}, map[string]any{"cache": "big"}); err == nil {
		t.Error("cache layer took options of another type")
	}
}
