package sockets

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/sockets/seccomp"
)

// A container process's seccomp listener (skiff's profile: its connect()
// and listen() calls) goes to the broker of the container it belongs to,
// which serves them with host sockets (shim/seccomp.c). The agent keeps a
// copy of each, so that a broker restarted after a crash serves them on;
// when every process of the filter has gone, the listener hangs up and is
// dropped.

// errNotReplaced: the process belongs to no local container with host
// sockets (its calls continue untouched: the overlay).
type errNotReplaced struct{ why string }

func (e errNotReplaced) Error() string { return e.why }

// giveNotify routes a listener to the broker of the container process pid
// belongs to: the local container with pid's network namespace, whose
// cgroup holds pid. It returns the container's ID.
func (b *brokers) giveNotify(pid int, f *os.File) (string, error) {
	var ns unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &ns); err != nil {
		return "", errNotReplaced{fmt.Sprintf("process %d: %v", pid, err)}
	}
	cg, err := cgroupOf(b.cfg.CgroupRoot, pid)
	if err != nil {
		return "", errNotReplaced{fmt.Sprintf("process %d: %v", pid, err)}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for id, s := range b.want {
		if s.e.NetnsDev != ns.Dev || s.e.NetnsIno != ns.Ino {
			continue
		}
		if cg != s.cgroup && !strings.HasPrefix(cg, s.cgroup+"/") {
			return "", errNotReplaced{fmt.Sprintf("process %d is in container %s's network namespace but not its cgroup (%s)", pid, id, cg)}
		}
		s.notify = append(s.notify, f)
		if s.ctl != nil {
			b.sendNotify(s, f)
		}
		return id, nil
	}
	return "", errNotReplaced{fmt.Sprintf("process %d is in no local container with host sockets", pid)}
}

// sendNotify passes a listener to s's broker. A broker that does not take
// it (gone, to be restarted) gets it when it is back.
func (b *brokers) sendNotify(s *brokerSpec, f *os.File) {
	if err := unix.Sendmsg(int(s.ctl.Fd()), []byte{'L'}, unix.UnixRights(int(f.Fd())), nil, unix.MSG_DONTWAIT); err != nil {
		b.log.Warn("seccomp listener not passed to the broker; passed to its next one", "container", s.e.ContainerID, "err", err)
	}
}

// cgroupOf is pid's cgroup v2 directory under root.
func cgroupOf(root string, pid int) (string, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rel, ok := strings.CutPrefix(line, "0::"); ok {
			return filepath.Join(root, rel), nil
		}
	}
	return "", fmt.Errorf("no cgroup v2 in /proc/%d/cgroup", pid)
}

// dropHung closes the listeners no process uses any more.
func (s *brokerSpec) dropHung() {
	kept := s.notify[:0]
	for _, f := range s.notify {
		if seccomp.Hung(f) {
			f.Close()
		} else {
			kept = append(kept, f)
		}
	}
	clear(s.notify[len(kept):])
	s.notify = kept
}

// close closes what the agent holds of s.
func (s *brokerSpec) close() {
	for _, f := range append([]*os.File{s.ln, s.ctl}, s.notify...) {
		if f != nil {
			f.Close()
		}
	}
	s.ln, s.ctl, s.notify = nil, nil, nil
}

// takeControl gets skiffd's end of the running broker pid's control socket
// back (an agent restarted while its brokers ran), or nil (a broker of an
// earlier version has none).
func takeControl(pid int) *os.File {
	fd, err := takeFD(pid, agentControlFD)
	if err != nil {
		return nil
	}
	typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	dom, derr := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	if err != nil || derr != nil || typ != unix.SOCK_SEQPACKET || dom != unix.AF_UNIX {
		unix.Close(fd)
		return nil
	}
	return os.NewFile(uintptr(fd), "control")
}

// takeNotify gets copies of the seccomp listeners the running broker pid
// serves.
func takeNotify(pid int) []*os.File {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, _ := os.ReadDir(dir)
	var fs []*os.File
	for _, ent := range ents {
		var n int
		if _, err := fmt.Sscan(ent.Name(), &n); err != nil {
			continue
		}
		if link, _ := os.Readlink(filepath.Join(dir, ent.Name())); link != "anon_inode:seccomp notify" {
			continue
		}
		if fd, err := takeFD(pid, n); err == nil {
			fs = append(fs, os.NewFile(uintptr(fd), "seccomp-notify"))
		}
	}
	return fs
}

func takeFD(pid, n int) (int, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1, err
	}
	defer unix.Close(pidfd)
	return unix.PidfdGetfd(pidfd, n, 0)
}
