package lab

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/skiffnet/skiff/cgroup"
)

// Down removes everything a lab made: its processes, namespaces (and with
// them every link inside) and its run directory. It works from whatever is
// left — a lab that crashed half-built has no complete state file — by
// finding the lab's namespaces by name and the processes by namespace.
func Down(ctx context.Context, name string) error {
	if name == "" {
		name = DefaultName
	}
	if !namePattern.MatchString(name) {
		return fmt.Errorf("lab name %q is not valid", name)
	}
	l := &Lab{Config: Config{Name: name}}
	if st, err := Open(name); err == nil {
		l = st
	}
	namespaces := l.namespaces()
	var errs []error
	// Agents first (so none re-creates anything), then everything else that
	// runs in the lab's namespaces: etcd, and processes tests or users
	// started there with lab exec.
	for _, h := range l.Hosts {
		errs = append(errs, stop(ctx, h.AgentPID, 5*time.Second))
	}
	for _, ns := range namespaces {
		errs = append(errs, l.killNetns(ctx, ns))
	}
	errs = append(errs, l.removeCgroups(), l.StopEtcd(ctx))
	errs = append(errs, os.RemoveAll(l.dir()),
		os.RemoveAll(filepath.Dir(l.bpfDir("h1"))))
	// The parent directory goes when no lab and no agent pins there any more.
	os.Remove(filepath.Dir(filepath.Dir(l.bpfDir("h1"))))
	return errors.Join(errs...)
}

// namespaces lists the lab's namespaces, containers first.
func (l *Lab) namespaces() []string {
	entries, _ := os.ReadDir("/run/netns")
	var containers, rest []string
	for _, e := range entries {
		n := e.Name()
		if !strings.HasPrefix(n, l.prefix()) {
			continue
		}
		if strings.Contains(strings.TrimPrefix(n, l.prefix()), "-c") {
			containers = append(containers, n)
		} else {
			rest = append(rest, n)
		}
	}
	return append(containers, rest...)
}

// killNetns stops every process inside namespace ns and deletes it.
func (l *Lab) killNetns(ctx context.Context, ns string) error {
	var st syscall.Stat_t
	if err := syscall.Stat(NetnsPath(ns), &st); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("stat %s: %w", ns, err)
	}
	want := fmt.Sprintf("net:[%d]", st.Ino)
	procs, _ := filepath.Glob("/proc/[0-9]*/ns/net")
	var errs []error
	for _, p := range procs {
		if link, err := os.Readlink(p); err == nil && link == want {
			pid, _ := strconv.Atoi(strings.Split(p, "/")[2])
			if pid != os.Getpid() {
				errs = append(errs, stop(ctx, pid, 3*time.Second))
			}
		}
	}
	if err := run("ip", "netns", "del", ns); err != nil && !strings.Contains(err.Error(), "No such file") {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// removeCgroups removes the lab's container cgroups (sockets mode), once
// their processes are gone.
func (l *Lab) removeCgroups() error {
	if !cgroup.Mounted() {
		return nil
	}
	dir, err := l.cgroupDir()
	if err != nil {
		return err
	}
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	var errs []error
	for _, e := range entries {
		if e.IsDir() {
			errs = append(errs, cgroup.Remove(filepath.Join(dir, e.Name())))
		}
	}
	return errors.Join(append(errs, cgroup.Remove(dir))...)
}
