// Package version says which skiff a binary is: its release and the commit
// it was built from (the Go toolchain's VCS stamp; make build keeps it on).
package version

import (
	"runtime/debug"
	"sync"
)

// Release is the version of skiff this tree builds.
const Release = "0.3.0-dev"

// Commit returns the VCS revision the running binary was built from, with
// "-dirty" for uncommitted changes, or "unknown" without a stamp.
var Commit = sync.OnceValue(func() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	rev, dirty := "unknown", false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if dirty && rev != "unknown" {
		rev += "-dirty"
	}
	return rev
})

// String is the release and the commit, as the binaries print them.
func String() string {
	c := Commit()
	if len(c) > 12 && c != "unknown" {
		short := c[:12]
		if len(c) > 40 {
			short += c[40:] // "-dirty"
		}
		c = short
	}
	return Release + " (commit " + c + ")"
}
