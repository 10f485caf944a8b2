// Package bpffs keeps skiff's pinned eBPF state on the bpf filesystem, where
// it outlives the agent.
package bpffs

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Root is where the bpf filesystem is conventionally mounted.
const Root = "/sys/fs/bpf"

// Mount mounts the bpf filesystem at Root unless it is there.
func Mount() error {
	var st unix.Statfs_t
	if err := unix.Statfs(Root, &st); err == nil && st.Type == unix.BPF_FS_MAGIC {
		return nil
	}
	if err := os.MkdirAll(Root, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("bpf", Root, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs at %s: %w", Root, err)
	}
	return nil
}

// Ensure creates dir on a bpf filesystem, mounting Root first if dir is
// below it.
func Ensure(dir string) error {
	if strings.HasPrefix(dir, Root+"/") {
		if err := Mount(); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("pin directory %s: %w", dir, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", dir, err)
	}
	if st.Type != unix.BPF_FS_MAGIC {
		return fmt.Errorf("%s is not on a bpf filesystem (mount -t bpf bpf /sys/fs/bpf)", dir)
	}
	return nil
}

// Unpin removes the pins in dir whose names start with prefix.
func Unpin(dir, prefix string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix) {
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				return fmt.Errorf("unpin %s: %w", e.Name(), err)
			}
		}
	}
	return nil
}

// Load loads spec (its configuration constants set through the bpf2go
// variable specs) into objs (a bpf2go objects struct) with its maps
// pinned in dir, reusing maps an earlier run pinned there. A pinned map
// whose definition changed (a new skiff version) is unpinned and replaced
// by an empty one; the other maps keep what they hold, and pinned links
// stay attached until the caller updates them, so the hooks never go
// without a program.
func Load(spec *ebpf.CollectionSpec, objs any, dir string, log *slog.Logger) error {
	if err := Ensure(dir); err != nil {
		return err
	}
	stale, err := unpinIncompatible(spec, dir)
	if err != nil {
		return err
	}
	if len(stale) > 0 {
		log.Warn("pinned maps do not match this version; they start empty", "dir", dir, "maps", stale)
	}
	err = spec.LoadAndAssign(objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}})
	var ve *ebpf.VerifierError
	if errors.As(err, &ve) {
		return fmt.Errorf("%+v", ve)
	}
	return err
}

// unpinIncompatible removes the pins in dir of spec's maps that this
// version cannot use, and returns their names.
func unpinIncompatible(spec *ebpf.CollectionSpec, dir string) ([]string, error) {
	var stale []string
	for name, ms := range spec.Maps {
		if ms.Pinning != ebpf.PinByName {
			continue
		}
		path := filepath.Join(dir, name)
		m, err := ebpf.LoadPinnedMap(path, nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err == nil {
			err = compatible(ms, m)
			m.Close()
		}
		if err == nil {
			continue
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("unpin %s: %w", name, err)
		}
		stale = append(stale, name)
	}
	slices.Sort(stale)
	return stale, nil
}

// compatible reports why m cannot serve as ms: its own definition (type,
// sizes, flags, and the layout of key and value), or for an array of maps,
// that of an inner map it holds (the kernel would refuse the new version's
// inner maps).
func compatible(ms *ebpf.MapSpec, m *ebpf.Map) error {
	if err := ms.Compatible(m); err != nil {
		return err
	}
	if err := sameLayout(ms, m); err != nil {
		return err
	}
	if ms.Type != ebpf.ArrayOfMaps {
		return nil
	}
	for i := range ms.MaxEntries {
		var id ebpf.MapID
		if err := m.Lookup(i, &id); errors.Is(err, ebpf.ErrKeyNotExist) {
			continue
		} else if err != nil {
			return err
		}
		inner, err := ebpf.NewMapFromID(id)
		if err == nil {
			err = compatible(ms.InnerMap, inner)
			inner.Close()
		}
		if err != nil {
			return fmt.Errorf("inner map %d: %w", i, err)
		}
	}
	return nil
}

// PinLink keeps prog attached with a link pinned at path: it updates the
// link an earlier run pinned there (the hook never goes without a
// program), or, when there is none or its target is gone (a recreated
// device or cgroup), attaches anew and pins the link.
func PinLink(path string, prog *ebpf.Program, attach func() (link.Link, error)) error {
	if old, err := link.LoadPinnedLink(path, nil); err == nil {
		defer old.Close()
		if err := old.Update(prog); err == nil {
			return nil
		}
		old.Unpin()
	}
	lk, err := attach()
	if err != nil {
		return fmt.Errorf("attach %s: %w", prog, err)
	}
	defer lk.Close()
	if err := lk.Pin(path); err != nil {
		return fmt.Errorf("pin link %s: %w", path, err)
	}
	return nil
}
