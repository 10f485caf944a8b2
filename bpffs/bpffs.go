// Package bpffs keeps skiff's pinned eBPF state on the bpf filesystem, where
// it outlives the agent.
package bpffs

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
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

// Load sets spec's configuration constants (volatile const globals) to
// vars and loads it into objs (a bpf2go objects struct) with its maps
// pinned in dir, reusing maps an earlier run pinned there. Pinned maps whose
// definition changed (a new skiff version) are unpinned — every pin whose
// name starts with prefix — and replaced by empty ones.
func Load(spec *ebpf.CollectionSpec, vars map[string]any, objs any, dir, prefix string, log *slog.Logger) error {
	for name, v := range vars {
		vs, ok := spec.Variables[name]
		if !ok {
			return fmt.Errorf("programs lack %s", name)
		}
		if err := vs.Set(v); err != nil {
			return fmt.Errorf("set %s: %w", name, err)
		}
	}
	if err := Ensure(dir); err != nil {
		return err
	}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}}
	err := spec.LoadAndAssign(objs, opts)
	if errors.Is(err, ebpf.ErrMapIncompatible) {
		log.Warn("pinned maps do not match this version; starting with empty ones", "dir", dir, "err", err)
		if err := Unpin(dir, prefix); err != nil {
			return err
		}
		err = spec.LoadAndAssign(objs, opts)
	}
	var ve *ebpf.VerifierError
	if errors.As(err, &ve) {
		return fmt.Errorf("%+v", ve)
	}
	return err
}
