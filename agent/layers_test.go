package agent

import (
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/sockets"
)

// TestNewLayers: a mode's layers run, every other registered layer is torn
// down at start.
func TestNewLayers(t *testing.T) {
	for mode, want := range map[string]struct{ run, down []string }{
		"overlay": {nil, []string{"cache", "channels", "sockets", "steering"}},
		"cache":   {[]string{"cache"}, []string{"channels", "sockets", "steering"}},
	} {
		chosen, _, err := layer.Choose(mode, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		layers, unwanted, err := newLayers(chosen, map[string]any{"cache": cache.Capacity{EgressIPs: 1, EgressHosts: 1, Ingress: 1, Filter: 1}})
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
	chosen, _, _ := layer.Choose("cache", nil, nil)
	if _, _, err := newLayers(chosen, map[string]any{"cache": "big"}); err == nil {
		t.Error("cache layer took options of another type")
	}
}

// TestAutoLeavesOutWhatCannotRun: in auto mode a layer whose probe fails
// (here the sockets layer without its broker, and with a cgroup root that
// cannot be mounted) is off with the probe's reason and is torn down, not
// started, at start; asked for by name it is an error.
func TestAutoLeavesOutWhatCannotRun(t *testing.T) {
	for name, opts := range map[string]sockets.Options{
		"the socket broker is missing":                   {Broker: "/nonexistent/skiff-broker"},
		"cgroup v2 is not mounted and cannot be mounted": {Broker: os.Args[0], CgroupRoot: "/proc/version/cgroup"},
	} {
		options := map[string]any{"sockets": opts}
		chosen, choices, err := layer.Choose(layer.Auto, nil, options)
		if err != nil {
			t.Fatal(err)
		}
		layers, unwanted, err := newLayers(chosen, options)
		if err != nil {
			t.Fatal(err)
		}
		// channels serves the sockets layer's host sockets in auto: off too.
		// (steering runs only when named.)
		if len(layers) != 1 || layers[0].name != "cache" || len(unwanted) != 3 || unwanted[0].Name != "channels" || unwanted[1].Name != "sockets" {
			t.Errorf("%s: runs %v, tears down %v; want cache, and channels, sockets and steering torn down", name, layers, unwanted)
		}
		if len(choices) != 4 || choices[2].On || !strings.Contains(choices[2].Reason, name) || choices[1].On || choices[1].Reason != "serves layer sockets, which is off" {
			t.Errorf("choices %+v, want channels off (serves sockets) and sockets off: %s", choices, name)
		}
		if _, _, err := layer.Choose("sockets", nil, options); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("mode sockets: %v, want %q", err, name)
		}
	}
}

// TestFeatures: a host announces what its layers offer peers with their
// options: the cache's rewriting tunnel, only when it rewrites.
func TestFeatures(t *testing.T) {
	chosen, _, err := layer.Choose("cache", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	for tunnel, want := range map[string][]string{
		cache.TunnelVXLAN:   nil,
		"":                  nil,
		cache.TunnelRewrite: {cache.FeatureRewrite},
	} {
		got := features(chosen, map[string]any{"cache": cache.Options{Tunnel: tunnel}})
		if !slices.Equal(got, want) {
			t.Errorf("tunnel %q announces %v, want %v", tunnel, got, want)
		}
	}
	if _, _, err := newLayers(chosen, map[string]any{"cache": cache.Options{Tunnel: "gre"}}); err == nil {
		t.Error("the cache layer took an unknown tunnel")
	}
}
