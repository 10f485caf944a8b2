package bpfmap

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/bpffs"
)

// TestUseOf: the maps pinned in a directory and below it are counted by
// what they hold, arrays are not, and programs' pins are passed over.
func TestUseOf(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("pinning eBPF maps needs root")
	}
	dir, err := os.MkdirTemp(bpffs.Root, "skiff-test-use-")
	if err != nil {
		t.Skip("no bpf filesystem:", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Mkdir(filepath.Join(dir, "layer"), 0o700); err != nil {
		t.Fatal(err)
	}
	pin := func(m *ebpf.Map, name string) {
		if err := m.Pin(filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	h := newMap(t, ebpf.Hash, 4, 64)
	for i := range uint32(5) {
		if err := h.Put(i, uint32(0)); err != nil {
			t.Fatal(err)
		}
	}
	pin(h, "layer/hash")
	lru := newMap(t, ebpf.LRUHash, 4, 128)
	pin(lru, "lru")
	arr := newMap(t, ebpf.Array, 4, 8)
	pin(arr, "array")
	lpm := newMap(t, ebpf.LPMTrie, 8, 16)
	if err := lpm.Put(lpmKey{Prefixlen: 24, IP: 0x0a000000}, uint32(1)); err != nil {
		t.Fatal(err)
	}
	pin(lpm, "trie")
	got, err := UseOf(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []Use{{"layer/hash", "Hash", 5, 64}, {"lru", "LRUHash", 0, 128}, {"trie", "LPMTrie", 1, 16}}
	if len(got) != len(want) {
		t.Fatalf("use %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("use %+v, want %+v", got[i], want[i])
		}
	}
}
