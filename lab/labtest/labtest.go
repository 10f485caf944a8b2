// Package labtest finds the built skiff binaries for tests that run them.
package labtest

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// BinDir returns $SKIFF_BIN_DIR (make test sets it) or the repository's
// bin/, and fails the test unless every named binary is there.
func BinDir(tb testing.TB, binaries ...string) string {
	tb.Helper()
	dir := os.Getenv("SKIFF_BIN_DIR")
	if dir == "" {
		_, file, _, _ := runtime.Caller(0)
		dir = filepath.Join(filepath.Dir(file), "..", "..", "bin")
	}
	for _, b := range binaries {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			tb.Fatalf("%s not found in %s: run make build (%v)", b, dir, err)
		}
	}
	return dir
}
