package layer_test

import (
	"os"
	"slices"
	"strings"
	"testing"

	_ "github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/channels"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/sockets"
	_ "github.com/skiffnet/skiff/steering"
)

// TestChooseModes: the registered layers, chosen by mode and by name, on
// this machine (which has what both need).
func TestChooseModes(t *testing.T) {
	// The test binary stands in for the broker.
	// (skiffd's: channels for containers' own sockets when named.)
	options := map[string]any{"sockets": sockets.Options{Secure: true, Broker: os.Args[0]}, "channels": channels.Options{Containers: true}}
	for _, tc := range []struct {
		mode  string
		names []string
		want  []string
	}{
		{"auto", nil, []string{"cache", "channels", "sockets"}},
		{"overlay", nil, nil},
		{"cache", nil, []string{"cache"}},
		{"sockets", nil, []string{"sockets"}},
		{"channels", nil, []string{"channels"}},
		{"steering", nil, []string{"steering"}},
		{"", []string{"sockets", "cache"}, []string{"sockets", "cache"}},
		{"", []string{"cache", "channels", "sockets"}, []string{"cache", "channels", "sockets"}},
		{"", []string{}, nil},
	} {
		regs, choices, err := layer.Choose(tc.mode, tc.names, options)
		if err != nil {
			t.Fatalf("mode %q layers %q: %v", tc.mode, tc.names, err)
		}
		var got []string
		for _, r := range regs {
			got = append(got, r.Name)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("mode %q layers %q runs %v, want %v", tc.mode, tc.names, got, tc.want)
		}
		if len(choices) != 4 || choices[0].Name != "cache" || choices[1].Name != "channels" || choices[2].Name != "sockets" || choices[3].Name != "steering" {
			t.Errorf("choices %+v, want one for each registered layer", choices)
		}
		for _, c := range choices {
			if c.On != slices.Contains(tc.want, c.Name) || c.On != (c.Reason == "") {
				t.Errorf("mode %q layers %q: %+v", tc.mode, tc.names, c)
			}
		}
	}
	for _, m := range layer.Modes() {
		if _, _, err := layer.Choose(m, nil, options); err != nil {
			t.Errorf("mode %s: %v", m, err)
		}
	}
	for _, tc := range []struct {
		mode  string
		names []string
		want  string
	}{
		{"", nil, `mode "" is not one of auto, overlay, cache, channels, sockets, steering`},
		{"Cache", nil, `mode "Cache" is not one of`},
		{"cache,sockets", nil, `mode "cache,sockets" is not one of`},
		{"auto", []string{"cache"}, "not both"},
		{"", []string{"warp"}, `unknown layer "warp" (layers: cache, channels, sockets, steering)`},
		{"", []string{"cache", "Cache"}, `unknown layer "Cache"`},
		{"", []string{"cache", "cache"}, `layer "cache" named twice`},
		{"", []string{""}, `unknown layer ""`},
	} {
		if _, _, err := layer.Choose(tc.mode, tc.names, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Choose(%q, %q) = %v, want an error with %q", tc.mode, tc.names, err, tc.want)
		}
	}
}

// TestNewOptions: a layer refuses options of another's type.
func TestNewOptions(t *testing.T) {
	regs := layer.Registered()
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
			Teardown: func(layer.Env, any) (bool, error) { return false, nil }},
		"no teardown": {Name: "warp", New: func(any) (layer.Layer, error) { return nil, nil }},
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
	if _, _, err := layer.Choose("", []string{"warp"}, nil); err == nil {
		t.Error("a refused registration is known")
	}
}
