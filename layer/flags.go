package layer

import (
	"flag"
	"fmt"
	"strings"
)

// Settings are skiffd's own settings that layers' options may depend on.
type Settings struct {
	// Mode is --mode ("" when --layers names the layers).
	Mode string
	// CgroupRoot is --cgroup-root: the cgroup v2 mount containers' cgroups
	// are under ("": found, or mounted).
	CgroupRoot string
}

// FlagOptions makes a layer's options from its flags, once they are
// parsed (Registration.Flags).
type FlagOptions func(Settings) (any, error)

// DefineFlags defines every registered layer's flags on fs. The function
// it returns makes each layer's options from them, by layer name, once fs
// is parsed.
func DefineFlags(fs *flag.FlagSet) func(Settings) (map[string]any, error) {
	makers := map[string]FlagOptions{}
	for _, r := range Registered() {
		if r.Flags != nil {
			makers[r.Name] = r.Flags(fs)
		}
	}
	return func(s Settings) (map[string]any, error) {
		out := map[string]any{}
		for name, make := range makers {
			o, err := make(s)
			if err != nil {
				return nil, fmt.Errorf("layer %s: %w", name, err)
			}
			out[name] = o
		}
		return out, nil
	}
}

// IsSet reports whether flag name was given (on the command line or in a
// configuration file).
func IsSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// SplitList splits a comma-separated flag value, without empty items.
func SplitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
