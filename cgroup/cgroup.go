// Package cgroup finds containers' cgroups as runtimes name them (a path
// on a cgroup v2 mount, one relative to it, or the systemd driver's
// "SLICE:PREFIX:NAME"), and the cgroup v2 mount the layers' eBPF hooks
// attach to (mounted where the machine has none).
package cgroup

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cluster"
)

// DefaultRoot is where skiff mounts cgroup v2 when the machine has no
// unified hierarchy at /sys/fs/cgroup (a cgroup v1 host).
const DefaultRoot = "/run/skiff/cgroup2"

func isCgroup2(dir string) bool {
	var st unix.Statfs_t
	return unix.Statfs(dir, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
}

// cgroup2Mounts are where distributions mount cgroup v2: the unified
// layout, and systemd's hybrid layout (v1 controllers beside it).
var cgroup2Mounts = []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}

// Root returns a cgroup v2 mount: the system's, or DefaultRoot,
// mounted if needed. The layer's hooks attach to cgroup v2 only; there is
// one v2 hierarchy however often it is mounted, and it needs no controller,
// so mounting it on a v1 host is fine.
func Root() (string, error) {
	for _, dir := range cgroup2Mounts {
		if isCgroup2(dir) {
			return dir, nil
		}
	}
	return DefaultRoot, Mount(DefaultRoot)
}

// Mounted reports whether a cgroup v2 mount Root would use is
// there (without mounting one).
func Mounted() bool {
	for _, dir := range append(cgroup2Mounts, DefaultRoot) {
		if isCgroup2(dir) {
			return true
		}
	}
	return false
}

// Mount mounts cgroup v2 at dir unless it is mounted there.
func Mount(dir string) error {
	if isCgroup2(dir) {
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	// Two agents starting at once may both mount; stacked mounts of the one
	// hierarchy are harmless.
	if err := unix.Mount("cgroup2", dir, "cgroup2", 0, ""); err != nil && !isCgroup2(dir) {
		return fmt.Errorf("mount cgroup2 at %s: %w", dir, err)
	}
	return nil
}

// Dir resolves a container's cgroup as runtimes pass it in CNI
// cgroupPath: an absolute path on a cgroup v2 mount, a path relative to
// root (the cgroup v2 mount containers' cgroups are under), or what the
// systemd cgroup driver names (SystemdPath).
func Dir(root string, e cluster.Endpoint) (string, error) {
	dir := e.Cgroup
	if p, ok := SystemdPath(dir); ok {
		dir = p
	}
	if !filepath.IsAbs(dir) || !isCgroup2(dir) {
		dir = filepath.Join(root, dir)
	}
	if !isCgroup2(dir) {
		return "", fmt.Errorf("cgroup %s is not a cgroup v2 directory (%s)", e.Cgroup, dir)
	}
	return dir, nil
}

// SystemdPath expands what a runtime with the systemd cgroup driver passes
// (runc's and containerd's "SLICE:PREFIX:NAME", the unit PREFIX-NAME.scope
// in SLICE, or a slice's name alone) into a path below the cgroup root,
// as systemd lays slices out: "a-b-c.slice" is a.slice/a-b.slice/
// a-b-c.slice. It reports false for anything else (a path).
func SystemdPath(p string) (string, bool) {
	parts := strings.Split(p, ":")
	switch {
	case len(parts) == 3:
		slice, err := sliceDir(cmp.Or(parts[0], "system.slice"))
		if err != nil || parts[2] == "" || strings.Contains(parts[1]+parts[2], "/") {
			return "", false
		}
		unit := parts[2]
		if !strings.HasSuffix(unit, ".slice") {
			unit = strings.TrimPrefix(parts[1]+"-"+unit, "-") + ".scope"
		}
		return filepath.Join(slice, unit), true
	case len(parts) == 1 && strings.HasSuffix(p, ".slice") && !strings.Contains(p, "/"):
		dir, err := sliceDir(p)
		return dir, err == nil
	}
	return "", false
}

// sliceDir is where systemd puts a slice: each dash-separated prefix is a
// parent slice ("-.slice" is the root).
func sliceDir(slice string) (string, error) {
	name, ok := strings.CutSuffix(slice, ".slice")
	if !ok || strings.Contains(name, "/") {
		return "", fmt.Errorf("%q is not a slice", slice)
	}
	if name == "-" {
		return "", nil
	}
	if name == "" || strings.HasPrefix(name, "-") || strings.HasSuffix(name, "-") || strings.Contains(name, "--") {
		return "", fmt.Errorf("%q is not a valid slice name", slice)
	}
	var dirs []string
	for i := range name {
		if name[i] == '-' {
			dirs = append(dirs, name[:i]+".slice")
		}
	}
	return filepath.Join(append(dirs, slice)...), nil
}

// ID is what bpf_get_current_cgroup_id returns for dir: its inode.
func ID(dir string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return 0, fmt.Errorf("cgroup %s: %w", dir, err)
	}
	return st.Ino, nil
}

// Remove removes a cgroup directory; a missing one is fine. A
// process still leaving it (a broker just told to stop) is waited for.
func Remove(dir string) error {
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		err := unix.Rmdir(dir)
		if err == nil || errors.Is(err, unix.ENOENT) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			return fmt.Errorf("remove cgroup %s: %w", dir, err)
		}
	}
}

// Rel is the cgroup a runtime's cgroupPath names, as a path from the
// cgroup v2 root ("/a/b"), whichever of its forms the runtime used (a
// path on a mount, relative to one, or systemd's), so two endpoints'
// cgroups compare, and compare with /proc's.
func Rel(p string) string {
	if sp, ok := SystemdPath(p); ok {
		return filepath.Clean("/" + sp)
	}
	mounts := append([]string{DefaultRoot}, cgroup2Mounts...)
	slices.SortFunc(mounts, func(a, b string) int { return len(b) - len(a) }) // /sys/fs/cgroup/unified before /sys/fs/cgroup
	for _, m := range mounts {
		if rest, ok := strings.CutPrefix(p, m+"/"); ok {
			return filepath.Clean("/" + rest)
		}
	}
	return filepath.Clean("/" + p)
}

// Own is the cgroup v2 path of this process ("/" when it has none).
func Own() string {
	p, err := Of("self")
	if err != nil {
		return "/"
	}
	return p
}

// Of is the cgroup v2 path of process pid ("self", or a number), from the
// cgroup v2 root as this process's cgroup namespace shows it.
func Of(pid string) (string, error) {
	data, err := os.ReadFile("/proc/" + pid + "/cgroup")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "0::"); ok {
			return filepath.Clean(rest), nil
		}
	}
	return "", fmt.Errorf("no cgroup v2 in /proc/%s/cgroup", pid)
}
