package bpfmap

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
)

// Use is how full a map is.
type Use struct {
	Name     string `json:"name"` // its pin's path below the directory walked
	Type     string `json:"type"`
	Entries  int    `json:"entries"`
	Capacity int    `json:"capacity"`
}

// Count counts m's entries by walking its keys, for the maps whose entries
// come and go (hash maps, LRU or not, LPM tries, sockhashes); ok is false
// for those whose size is fixed or that cannot be walked (arrays,
// per-socket storage, ring buffers).
func Count(m *ebpf.Map) (n int, ok bool, err error) {
	switch m.Type() {
	case ebpf.Hash, ebpf.LRUHash, ebpf.LRUCPUHash, ebpf.PerCPUHash, ebpf.LPMTrie, ebpf.SockHash:
	default:
		return 0, false, nil
	}
	key, next := make([]byte, m.KeySize()), make([]byte, m.KeySize())
	var cur any // nil: the first key
	for {
		err := m.NextKey(cur, next)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return n, true, nil
		}
		if err != nil {
			return n, true, fmt.Errorf("count %s: %w", m, err)
		}
		n++
		copy(key, next)
		cur = key
	}
}

// UseOf reports the use of every map pinned in dir or below it whose
// entries come and go (Count), in name order.
func UseOf(dir string) ([]Use, error) {
	var out []Use
	var errs []error
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return nil // a pinned program or link
		}
		defer m.Close()
		n, ok, err := Count(m)
		if err != nil {
			errs = append(errs, err)
		}
		if ok {
			name, _ := filepath.Rel(dir, path)
			out = append(out, Use{Name: name, Type: m.Type().String(), Entries: n, Capacity: int(m.MaxEntries())})
		}
		return nil
	})
	slices.SortFunc(out, func(a, b Use) int { return strings.Compare(a.Name, b.Name) })
	return out, errors.Join(append(errs, err)...)
}
