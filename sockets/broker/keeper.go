package broker

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/sockets/broker/seccomp"
)

// A container process's seccomp listener (skiff's profile: its connect()
// and listen() calls) goes to the broker of the container it belongs to,
// which serves them with host sockets (seccomp.c). The agent keeps a
// copy of each, so that a broker restarted after a crash serves them on;
// when every process of the filter has gone, the listener hangs up and is
// dropped.

// errNotReplaced: the process belongs to no local container with host
// sockets (its calls continue untouched: the overlay).
type errNotReplaced struct{ why string }

func (e errNotReplaced) Error() string { return e.why }

// GiveNotify routes a listener to the broker of the container process pid
// belongs to: the local container with pid's network namespace, whose
// cgroup holds pid. It returns the container's ID.
func (b *Supervisor) GiveNotify(pid int, f *os.File) (string, error) {
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
		if s.ctl == nil {
			// no broker (its address taken, failing to start) or one of an
			// earlier skiff: served by nobody, its calls would wait for good
			return "", errNotReplaced{fmt.Sprintf("container %s has no broker that takes seccomp listeners", id)}
		}
		s.notify = append(s.notify, f)
		s.unsent = append(s.unsent, f)
		b.sendUnsent(s)
		return id, nil
	}
	return "", errNotReplaced{fmt.Sprintf("process %d is in no local container with host sockets", pid)}
}

// keeperID names the keeper's files in the brokers' directory: no
// container ID starts with a dot.
const keeperID = ".keeper"

// GiveKeeper passes the listener of a process that gets no host sockets
// to the host's keeper (skiff-broker --keeper), which continues its every
// call and, unlike the agent, survives an agent restart: with no holder
// left the kernel would fail the calls. The agent keeps a copy, for the
// next keeper should this one die.
func (b *Supervisor) GiveKeeper(f *os.File) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.keep(f)
}

// keep is giveKeeper with b.mu held.
func (b *Supervisor) keep(f *os.File) {
	if b.keeper == nil {
		b.keeper = &brokerSpec{}
	}
	b.keeper.notify = append(b.keeper.notify, f)
	b.keeper.unsent = append(b.keeper.unsent, f)
	if b.Running(keeperID) == 0 {
		if err := b.startKeeper(); err != nil { // else the supervisor tries again
			b.log.Warn("start the seccomp keeper", "err", err)
		}
		return
	}
	b.sendUnsent(b.keeper)
}

// startKeeper starts the keeper and gives it the listeners held for it.
func (b *Supervisor) startKeeper() error {
	if err := b.spawn(keeperID, b.keeper, "--keeper"); err != nil {
		return fmt.Errorf("start the seccomp keeper: %w", err)
	}
	return nil
}

// sendUnsent passes s's unsent listeners to its broker, as far as its
// control socket takes them; the supervisor sends the rest later.
func (b *Supervisor) sendUnsent(s *brokerSpec) {
	for s.ctl != nil && len(s.unsent) > 0 {
		f := s.unsent[0]
		err := unix.Sendmsg(int(s.ctl.Fd()), []byte{'L'}, unix.UnixRights(int(f.Fd())), nil, unix.MSG_DONTWAIT)
		if errors.Is(err, unix.EAGAIN) {
			return
		}
		if err != nil { // the broker has gone: its successor gets them all
			b.log.Warn("seccomp listener not passed to the broker", "container", s.e.ContainerID, "err", err)
			return
		}
		s.unsent = s.unsent[1:]
	}
}

// cgroupOf is pid's cgroup v2 directory under root.
func cgroupOf(root string, pid int) (string, error) {
	rel, err := cgroup.Of(strconv.Itoa(pid))
	if err != nil {
		return "", err
	}
	return filepath.Join(root, rel), nil
}

// dropHung closes the listeners no process uses any more.
func (s *brokerSpec) dropHung() {
	hung := func(f *os.File) bool { return seccomp.Hung(f) }
	s.unsent = slices.DeleteFunc(s.unsent, hung)
	s.notify = slices.DeleteFunc(s.notify, func(f *os.File) bool {
		if hung(f) {
			f.Close()
			return true
		}
		return false
	})
}

// close closes what the agent holds of s but the seccomp listeners still
// in use, which it returns.
func (s *brokerSpec) close() []*os.File {
	s.dropHung()
	for _, f := range []*os.File{s.ln, s.ctl} {
		if f != nil {
			f.Close()
		}
	}
	live := s.notify
	s.ln, s.ctl, s.notify, s.unsent = nil, nil, nil, nil
	return live
}

// takeControl gets skiffd's end of the running broker pid's control socket
// back (an agent restarted while its brokers ran), or nil (a broker of an
// earlier version has none).
func takeControl(pid int) *os.File {
	fd, err := takeFD(pid, agentControlFD)
	if err != nil {
		return nil
	}
	// a socket pair's end: unnamed (a shim's connection, which a broker
	// of an earlier version may have at that number, is named)
	typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	dom, derr := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	sa, serr := unix.Getsockname(fd)
	ua, _ := sa.(*unix.SockaddrUnix)
	// (x/sys reports an unnamed socket's empty address as "@")
	if err != nil || derr != nil || serr != nil || typ != unix.SOCK_SEQPACKET || dom != unix.AF_UNIX || ua == nil || (ua.Name != "" && ua.Name != "@") {
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
