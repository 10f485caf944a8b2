package bpffs

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

type testObjs struct {
	Keep   *ebpf.Map `ebpf:"t_keep"`
	Change *ebpf.Map `ebpf:"t_change"`
	Outer  *ebpf.Map `ebpf:"t_outer"`
	Layout *ebpf.Map `ebpf:"t_layout"`
}

func (o *testObjs) close() {
	for _, m := range []*ebpf.Map{o.Keep, o.Change, o.Outer, o.Layout} {
		m.Close()
	}
}

// testSpec is a version of a layer's maps: changeValue is the value size
// of t_change, innerValue that of t_outer's inner maps; swapped trades the
// places of the two fields of t_layout's value (same size, same types).
func testSpec(changeValue, innerValue uint32, swapped bool) *ebpf.CollectionSpec {
	u32 := &btf.Int{Name: "__u32", Size: 4}
	first, second := "local", "peer"
	if swapped {
		first, second = second, first
	}
	value := &btf.Struct{Name: "info", Size: 8, Members: []btf.Member{{Name: first, Type: u32}, {Name: second, Type: u32, Offset: 32}}}
	return &ebpf.CollectionSpec{Maps: map[string]*ebpf.MapSpec{
		"t_keep":   {Name: "t_keep", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 16, Pinning: ebpf.PinByName},
		"t_change": {Name: "t_change", Type: ebpf.Hash, KeySize: 4, ValueSize: changeValue, MaxEntries: 16, Pinning: ebpf.PinByName},
		"t_outer": {Name: "t_outer", Type: ebpf.ArrayOfMaps, KeySize: 4, ValueSize: 4, MaxEntries: 1, Pinning: ebpf.PinByName,
			InnerMap: &ebpf.MapSpec{Name: "t_inner", Type: ebpf.Array, KeySize: 4, ValueSize: innerValue, MaxEntries: 1}},
		"t_layout": {Name: "t_layout", Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 16, Pinning: ebpf.PinByName,
			Key: u32, Value: value},
	}}
}

// TestLoadKeepsCompatibleMaps: a new version replaces only the pinned maps
// it cannot use — one whose value size changed, one whose value's fields
// traded places, and an array of maps whose inner maps changed — and keeps
// the others' contents and every other pin.
func TestLoadKeepsCompatibleMaps(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if err := Mount(); err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp(Root, "skiff-bpffs-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	load := func(spec *ebpf.CollectionSpec) *testObjs {
		t.Helper()
		var o testObjs
		if err := Load(spec, &o, dir, log); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(o.close)
		return &o
	}

	v1 := load(testSpec(4, 8, false))
	if err := v1.Keep.Put(uint32(1), uint64(42)); err != nil {
		t.Fatal(err)
	}
	if err := v1.Change.Put(uint32(1), uint32(7)); err != nil {
		t.Fatal(err)
	}
	if err := v1.Layout.Put(uint32(1), uint64(7)); err != nil {
		t.Fatal(err)
	}
	inner, err := ebpf.NewMap(testSpec(4, 8, false).Maps["t_outer"].InnerMap)
	if err != nil {
		t.Fatal(err)
	}
	defer inner.Close()
	if err := v1.Outer.Put(uint32(0), inner); err != nil {
		t.Fatal(err)
	}
	// A pin the spec does not name, like a layer's pinned links.
	other, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := other.Pin(filepath.Join(dir, "t_links")); err != nil {
		t.Fatal(err)
	}

	same := load(testSpec(4, 8, false)) // a restart of the same version
	var v uint64
	if err := same.Keep.Lookup(uint32(1), &v); err != nil || v != 42 || logs.Len() != 0 {
		t.Fatalf("restart: t_keep[1] = %d (%v); log %q", v, err, logs.String())
	}
	if err := same.Layout.Lookup(uint32(1), &v); err != nil || v != 7 {
		t.Fatalf("restart: t_layout[1] = %d (%v)", v, err)
	}

	v2 := load(testSpec(8, 16, true))
	if err := v2.Keep.Lookup(uint32(1), &v); err != nil || v != 42 {
		t.Errorf("t_keep lost its contents: %d (%v)", v, err)
	}
	if err := v2.Change.Lookup(uint32(1), &v); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("t_change kept an entry of the old layout: %v", err)
	}
	if err := v2.Layout.Lookup(uint32(1), &v); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("t_layout kept an entry of the old layout: %v", err)
	}
	var id ebpf.MapID
	if err := v2.Outer.Lookup(uint32(0), &id); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("t_outer kept an inner map of the old layout: %v", err)
	}
	newInner, err := ebpf.NewMap(testSpec(8, 16, true).Maps["t_outer"].InnerMap)
	if err != nil {
		t.Fatal(err)
	}
	defer newInner.Close()
	if err := v2.Outer.Put(uint32(0), newInner); err != nil {
		t.Errorf("the new version's inner map does not fit t_outer: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "t_links")); err != nil {
		t.Errorf("another pin went: %v", err)
	}
	if !strings.Contains(logs.String(), "maps=\"[t_change t_layout t_outer]\"") {
		t.Errorf("log does not name the replaced maps: %q", logs.String())
	}
}
