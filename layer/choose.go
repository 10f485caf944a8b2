package layer

import (
	"fmt"
	"slices"
	"strings"

	"github.com/skiffnet/skiff/api"
)

// Modes the data plane can run in: auto (every layer the host can run),
// overlay (none), or one registered layer alone.
func Modes() []string {
	modes := []string{Auto, "overlay"}
	for _, r := range Registered() {
		modes = append(modes, r.Name)
	}
	return modes
}

// Auto is the mode that runs every layer this host can run.
const Auto = "auto"

// Choose picks the layers of a start: with names (skiffd --layers),
// exactly those; otherwise mode's (cluster.Modes): auto every registered
// layer whose Probe passes, overlay none, a layer's name that layer alone.
// A layer asked for by name must pass its probe; auto turns off the ones
// that do not, with the probe's answer as the reason. It returns the
// layers to run, in order, and for every registered layer whether it is on, and why not.
func Choose(mode string, names []string, options map[string]any) ([]Registration, []api.Layer, error) {
	return choose(Registered(), mode, names, options)
}

func choose(all []Registration, mode string, names []string, options map[string]any) ([]Registration, []api.Layer, error) {
	auto := false
	switch {
	case names != nil && mode != "":
		return nil, nil, fmt.Errorf("give a mode (%s) or a list of layers, not both", mode)
	case names != nil:
		mode = "layers " + strings.Join(names, ",")
	case mode == Auto:
		auto = true
	case mode == "overlay":
		names = []string{}
	case slices.ContainsFunc(all, func(r Registration) bool { return r.Name == mode }):
		names = []string{mode}
	default:
		modes := []string{Auto, "overlay"}
		for _, r := range all {
			modes = append(modes, r.Name)
		}
		return nil, nil, fmt.Errorf("mode %q is not one of %s", mode, strings.Join(modes, ", "))
	}
	if !auto {
		if err := known(all, names); err != nil {
			return nil, nil, err
		}
	}
	var choices []api.Layer
	for _, r := range all {
		c := api.Layer{Name: r.Name, On: true}
		if !auto && !slices.Contains(names, r.Name) {
			c.On, c.Reason = false, "not in "+mode
		} else if auto && r.Manual != "" {
			c.On, c.Reason = false, r.Manual
		} else if r.Probe != nil {
			if err := r.Probe(options[r.Name]); err != nil {
				if !auto {
					return nil, nil, fmt.Errorf("layer %s cannot run on this host: %w", r.Name, err)
				}
				c.On, c.Reason = false, err.Error()
			}
		}
		choices = append(choices, c)
	}
	// A layer that serves others runs beside them only (until none is
	// turned off: one turned off may be another's).
	for changed := true; changed; {
		changed = false
		for i, r := range all {
			if !choices[i].On || r.With == nil {
				continue
			}
			for _, w := range r.With(options[r.Name]) {
				j := slices.IndexFunc(all, func(r Registration) bool { return r.Name == w })
				if j >= 0 && choices[j].On {
					continue
				}
				if !auto {
					return nil, nil, fmt.Errorf("layer %s serves layer %s: run both (--layers)", r.Name, w)
				}
				choices[i].On, choices[i].Reason, changed = false, fmt.Sprintf("serves layer %s, which is off", w), true
				break
			}
		}
	}
	// In the order asked for (the order of Sync and Settle); auto: by name.
	if auto {
		names = nil
		for _, r := range all {
			names = append(names, r.Name)
		}
	}
	var run []Registration
	for _, n := range names {
		if i := slices.IndexFunc(all, func(r Registration) bool { return r.Name == n }); choices[i].On {
			run = append(run, all[i])
		}
	}
	return run, choices, nil
}

// known checks that names are registered, once each.
func known(all []Registration, names []string) error {
	for i, n := range names {
		if !slices.ContainsFunc(all, func(r Registration) bool { return r.Name == n }) {
			var known []string
			for _, r := range all {
				known = append(known, r.Name)
			}
			return fmt.Errorf("unknown layer %q (layers: %s)", n, strings.Join(known, ", "))
		}
		if slices.Contains(names[:i], n) {
			return fmt.Errorf("layer %q named twice", n)
		}
	}
	return nil
}
