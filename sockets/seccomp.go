package sockets

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

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
		if s.ctl == nil && b.running(id) > 0 {
			// served by nobody, its calls would wait for good
			return "", errNotReplaced{fmt.Sprintf("container %s's broker takes no seccomp listeners (an earlier skiff's)", id)}
		}
		s.notify = append(s.notify, f)
		if s.ctl != nil {
			b.sendNotify(s, f)
		}
		return id, nil
	}
	return "", errNotReplaced{fmt.Sprintf("process %d is in no local container with host sockets", pid)}
}

// keeperID names the keeper's files in the brokers' directory: no
// container ID starts with a dot.
const keeperID = ".keeper"

// giveKeeper passes the listener of a process that gets no host sockets
// to the host's keeper (skiff-broker --keeper), which continues its every
// call and, unlike the agent, survives an agent restart: with no holder
// left the kernel would fail the calls. The agent keeps a copy, for the
// next keeper should this one die.
func (b *brokers) giveKeeper(f *os.File) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.keeper == nil {
		b.keeper = &brokerSpec{}
	}
	b.keeper.notify = append(b.keeper.notify, f)
	if b.running(keeperID) == 0 {
		if err := b.startKeeper(); err != nil { // sends it; else the supervisor tries again
			b.log.Warn("start the seccomp keeper", "err", err)
		}
		return
	}
	b.sendNotify(b.keeper, f)
}

// startKeeper starts the keeper and gives it the listeners held for it.
func (b *brokers) startKeeper() error {
	if err := os.MkdirAll(b.dir(), 0o755); err != nil {
		return fmt.Errorf("broker state: %w", err)
	}
	logf, err := os.OpenFile(filepath.Join(b.dir(), keeperID+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("keeper log: %w", err)
	}
	defer logf.Close()
	ctl, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("keeper control socket: %w", err)
	}
	brokerEnd, agentEnd := os.NewFile(uintptr(ctl[0]), "keeper-control"), os.NewFile(uintptr(ctl[1]), "control")
	defer brokerEnd.Close()
	cmd := exec.Command(b.cfg.Broker, "--keeper", "--control-fd", strconv.Itoa(brokerControlFD))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{nil, brokerEnd, agentEnd} // the descriptors a broker has
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		agentEnd.Close()
		return fmt.Errorf("start the seccomp keeper: %w", err)
	}
	go cmd.Wait()
	if err := os.WriteFile(b.pidFile(keeperID), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		return fmt.Errorf("keeper pid file: %w", err)
	}
	if b.keeper.ctl != nil {
		b.keeper.ctl.Close()
	}
	b.keeper.ctl = agentEnd
	for _, f := range b.keeper.notify {
		b.sendNotify(b.keeper, f)
	}
	b.log.Info("seccomp keeper started", "pid", cmd.Process.Pid)
	return nil
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
