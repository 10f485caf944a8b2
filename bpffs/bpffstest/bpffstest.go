// Package bpffstest gives tests that load eBPF a private directory on the
// bpf filesystem.
package bpffstest

import (
	"os"
	"testing"

	"github.com/skiffnet/skiff/bpffs"
)

// Dir returns a new directory on the bpf filesystem (mounted if need be),
// removed with everything pinned in it when tb ends. Without root, tb is
// skipped: loading eBPF needs it.
func Dir(tb testing.TB) string {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("loading eBPF needs root")
	}
	if err := bpffs.Mount(); err != nil {
		tb.Fatal(err)
	}
	dir, err := os.MkdirTemp(bpffs.Root, "skiff-test-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
