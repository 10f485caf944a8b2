// Package flagfile reads a program's flags from a file: one
// "flag = value" a line (deploy/skiffd.conf is skiffd's).
package flagfile

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/skiffnet/skiff/layer"
)

// Apply sets the flags a config file names (one "flag = value" a line,
// the flag's name without dashes; "#" starts a comment) unless the command
// line gave them: the file holds a host's settings, the command line
// overrides one for a run. A key that is not a flag of fs, or a value the
// flag refuses, is an error naming its line.
func Apply(fs *flag.FlagSet, path string) error { return apply(fs, path, true) }

// ApplyKnown is Apply for another program's file (skiff doctor reading
// skiffd's): keys that are not flags of fs are skipped.
func ApplyKnown(fs *flag.FlagSet, path string) error { return apply(fs, path, false) }

func apply(fs *flag.FlagSet, path string, strict bool) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("--config: %w", err)
	}
	defer f.Close()
	seen := map[string]int{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		if line == "" {
			continue
		}
		key, value, ok := strings.Cut(line, "=")
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		if !ok || key == "" {
			return fmt.Errorf("%s:%d: want flag = value, got %q", path, n, line)
		}
		key = strings.TrimLeft(key, "-")
		if key == "config" || fs.Lookup(key) == nil {
			if !strict {
				continue
			}
			return fmt.Errorf("%s:%d: %q is not a %s flag (%s --help lists them)", path, n, key, fs.Name(), fs.Name())
		}
		if first, dup := seen[key]; dup {
			return fmt.Errorf("%s:%d: %s given again (first on line %d)", path, n, key, first)
		}
		seen[key] = n
		if layer.IsSet(fs, key) {
			continue
		}
		if err := fs.Set(key, strings.Trim(value, `"`)); err != nil {
			return fmt.Errorf("%s:%d: %s: %w", path, n, key, err)
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	return nil
}
