// Package broker runs the sockets layer's per-container socket brokers:
// skiff-broker (broker.c), which hands a container's processes host sockets
// (through the shim, sockets/shim, over the protocol of skiff_broker.h) and
// serves the seccomp listeners of processes under skiff's profile
// (seccomp.c, the receiver of the runtimes' handoffs in ./seccomp); the
// seccomp keeper, which answers the listeners of processes without host
// sockets; and skiff-seccomp-exec (seccomp_exec.c), which starts a process
// under the profile.
package broker

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cluster"
)

// Supervisor runs one skiff-broker per replaced container and restarts any
// that dies. A broker runs in the host namespace and in the container's
// cgroup (the cgroup a socket is created in selects its hooks) and serves
// the container at an abstract Unix address inside the container's
// namespace. The agent binds that address itself, in CNI ADD, before the
// container's processes run, and holds the listener for as long as the
// endpoint lives; every broker it starts serves the same listener. An
// abstract name stays bound while any descriptor of its socket is open, so
// no process of the container can bind it first (and serve the shims as an
// impostor) or make the broker's bind fail. Brokers outlive the agent: a
// restarted agent adopts them by their pid files, and takes a descriptor of
// the listener back from the broker.
type Supervisor struct {
	cfg  Config
	log  *slog.Logger
	mu   sync.Mutex
	want map[string]*brokerSpec // by container ID
	// keeper serves the seccomp listeners of processes that get no host
	// sockets (keeper.go); nil until the first.
	keeper *brokerSpec
	quit   chan struct{}
	done   chan struct{}
}

// Config is what the brokers of a host share.
type Config struct {
	Binary     string       // skiff-broker
	StateDir   string       // pid, log and counters files (StateDir/brokers)
	CIDR       netip.Prefix // the cluster's: connections there get host sockets
	Secure     bool         // refuse host sockets to containers holding CAP_NET_ADMIN on the host
	CgroupRoot string       // cgroup v2 mount: a seccomp listener's process is placed by its cgroup
	// OpenNetns opens a container's network namespace, the one it was
	// attached in (overlay.OpenNetns).
	OpenNetns func(cluster.Endpoint) (netns.NsHandle, error)
}

type brokerSpec struct {
	e      cluster.Endpoint
	cgroup string
	// ln is the broker's listener, bound in the container's netns; nil
	// while another process holds the address (the container's sockets
	// then stay on the overlay) or the agent has not got it back yet.
	ln       *os.File
	squatted bool // the address was taken when last tried: logged once
	// ctl is skiffd's end of the broker's control socket (seccomp
	// listeners go to the broker through it); nil while no broker runs
	// or one adopted after a restart had none.
	ctl *os.File
	// notify are the seccomp listeners of the container's processes
	// (keeper.go): the broker serves them; skiffd keeps a copy for
	// the next broker should this one die. unsent are those not passed
	// to the running broker yet (its control socket was full).
	notify, unsent []*os.File
}

// brokerName is the broker's abstract address in the container's netns
// (skiff_broker.h, SKIFF_BROKER_NAME).
const brokerName = "skiff-broker"

// The descriptors a broker starts with (exec's ExtraFiles): the listener,
// its end of the control socket, and skiffd's end, which it only keeps
// open so that a restarted skiffd can take it back.
const (
	brokerListenFD  = 3
	brokerControlFD = 4
	agentControlFD  = 5
)

// errAddressTaken: another process holds the broker's address in the
// container's netns.
var errAddressTaken = errors.New("the broker's address @" + brokerName + " is bound by another process of the container")

// listenIn binds the broker's address in e's network namespace (only the
// one it was attached in: Config.OpenNetns). An abstract AF_UNIX name
// belongs to the netns of the socket, fixed when the socket is created:
// only the socket() call needs the namespace.
func (b *Supervisor) listenIn(e cluster.Endpoint) (*os.File, error) {
	ns, err := b.cfg.OpenNetns(e)
	if err != nil {
		return nil, fmt.Errorf("open netns: %w", err)
	}
	defer ns.Close()
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		host, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{-1, fmt.Errorf("own netns: %w", err)}
			return
		}
		defer host.Close()
		if err := netns.Set(ns); err != nil {
			runtime.UnlockOSThread()
			ch <- result{-1, fmt.Errorf("enter netns %s: %w", e.Netns, err)}
			return
		}
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		if serr := netns.Set(host); serr != nil {
			// the thread stays locked, in the container's netns, and
			// ends with this goroutine
			if err == nil {
				unix.Close(fd)
			}
			ch <- result{-1, fmt.Errorf("back to the host netns: %w", serr)}
			return
		}
		runtime.UnlockOSThread()
		ch <- result{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		return nil, fmt.Errorf("broker socket in %s: %w", e.Netns, r.err)
	}
	if err := unix.Bind(r.fd, &unix.SockaddrUnix{Name: "@" + brokerName}); err != nil {
		unix.Close(r.fd)
		if errors.Is(err, unix.EADDRINUSE) {
			return nil, errAddressTaken
		}
		return nil, fmt.Errorf("bind @%s in %s: %w", brokerName, e.Netns, err)
	}
	if err := unix.Listen(r.fd, 512); err != nil {
		unix.Close(r.fd)
		return nil, fmt.Errorf("listen on @%s in %s: %w", brokerName, e.Netns, err)
	}
	return os.NewFile(uintptr(r.fd), "@"+brokerName), nil
}

// takeListener gets a descriptor of the listener of the running broker pid
// (an agent restarted while its brokers ran), or nil. Only a listening Unix
// socket at the broker's address qualifies: a broker of an earlier version
// bound its own, at another number.
func takeListener(pid int) *os.File {
	fd, err := takeFD(pid, brokerListenFD)
	if err != nil {
		return nil
	}
	listening, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
	sa, serr := unix.Getsockname(fd)
	if ua, ok := sa.(*unix.SockaddrUnix); err != nil || serr != nil || listening != 1 || !ok || ua.Name != "@"+brokerName {
		unix.Close(fd)
		return nil
	}
	return os.NewFile(uintptr(fd), "@"+brokerName)
}

// superviseEvery is how often dead brokers are looked for.
const superviseEvery = 200 * time.Millisecond

// New supervises the brokers of cfg's host, adopting the keeper an
// earlier agent left running. cfg.OpenNetns is required.
func New(cfg Config, log *slog.Logger) *Supervisor {
	b := &Supervisor{cfg: cfg, log: log, want: map[string]*brokerSpec{}, quit: make(chan struct{}), done: make(chan struct{})}
	if pid := b.Running(keeperID); pid > 0 { // an agent restarted: its keeper runs on
		b.keeper = &brokerSpec{ctl: takeControl(pid), notify: takeNotify(pid)}
	}
	go b.supervise()
	return b
}

func (b *Supervisor) dir() string { return filepath.Join(b.cfg.StateDir, "brokers") }
func (b *Supervisor) pidFile(id string) string {
	return filepath.Join(b.dir(), id+".pid")
}

// statsFile is where a container's broker keeps its counters.
func statsFile(stateDir, containerID string) string {
	return filepath.Join(stateDir, "brokers", containerID+".stats")
}

// Stats are a broker's counters. Replaced and fallback are what its
// shims reported, flushed with their next request or at exit.
type Stats struct {
	HandedOut uint64 // host sockets sent to the container's processes
	Replaced  uint64 // connections and listeners on host sockets
	Fallback  uint64 // sockets that fell back to the overlay
	// Privileged is the process (pid) of the container that holds
	// CAP_NET_ADMIN or CAP_SYS_ADMIN in the host's user namespace, for
	// which the broker refuses the container host sockets; 0 if none.
	Privileged int
	Seccomp    SeccompStats
}

// SeccompStats are what a broker's seccomp agent did with the container's
// connect() and listen() calls (seccomp.c).
type SeccompStats struct {
	Listeners uint64 // notification listeners it serves
	Replaced  uint64 // calls moved to host sockets
	Fallback  uint64 // calls in the cluster left on the container's socket
	Passed    uint64 // calls continued untouched (not for the fast path)
	Dropped   uint64 // notifications whose caller went meanwhile
	Handled   uint64 // notifications answered
	Nanos     uint64 // time from receiving to answering, over Handled
}

// brokerStatsMagic opens a ready broker's counters file: "SKST" and the
// layout version (skiff_broker.h); layout 2 (a broker of an earlier
// skiff, still running) lacks the seccomp counters.
const (
	brokerStatsMagic   = 0x354534b53
	brokerStatsMagicV2 = 0x254534b53
)

// ReadStats reads a container's broker counters; zero while the
// broker is not (or not yet) running.
func ReadStats(stateDir, containerID string) Stats {
	data, err := os.ReadFile(statsFile(stateDir, containerID))
	if err != nil || len(data) < 72 {
		return Stats{}
	}
	magic := binary.NativeEndian.Uint64(data)
	if magic != brokerStatsMagic && magic != brokerStatsMagicV2 {
		return Stats{}
	}
	u := func(i int) uint64 { return binary.NativeEndian.Uint64(data[8*i:]) }
	bs := Stats{HandedOut: u(1), Replaced: u(2), Fallback: u(3), Privileged: int(u(8))}
	if magic == brokerStatsMagic && len(data) >= 16*8 {
		bs.Seccomp = SeccompStats{Listeners: u(9), Replaced: u(10), Fallback: u(11), Passed: u(12),
			Dropped: u(13), Nanos: u(14), Handled: u(15)}
	}
	return bs
}

// Ensure starts e's broker unless it runs. An address another process of
// the container holds is logged, not returned: the container's sockets stay
// on the overlay, and the agent's syncs must not fail for what a container
// does.
func (b *Supervisor) Ensure(e cluster.Endpoint, cgroup string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.want[e.ContainerID]
	if s != nil && s.e.Netns != e.Netns {
		// the runtime recreated the sandbox: a broker and a listener of
		// the old namespace serve nobody. The broker stops before the
		// keeper gets its seccomp listeners: never two holders of one.
		live := s.close()
		err := stopBroker(b.cfg.StateDir, e.ContainerID)
		for _, f := range live {
			b.keep(f)
		}
		if err != nil {
			return err
		}
		s = nil
	}
	if s == nil {
		s = &brokerSpec{}
		b.want[e.ContainerID] = s
	}
	s.e, s.cgroup = e, cgroup
	if pid := b.Running(e.ContainerID); pid > 0 {
		if s.ln == nil {
			s.ln = takeListener(pid)
		}
		if s.ctl == nil {
			s.ctl = takeControl(pid)
			s.notify = takeNotify(pid)
		}
		return nil
	}
	return b.start(s)
}

func (b *Supervisor) start(s *brokerSpec) error {
	id := s.e.ContainerID
	if s.ln == nil {
		ln, err := b.listenIn(s.e)
		if errors.Is(err, errAddressTaken) {
			if !s.squatted {
				b.log.Error("socket broker not started: its address is taken; the container's sockets stay on the overlay",
					"container", id, "netns", s.e.Netns, "err", err)
			}
			s.squatted = true
			return nil
		}
		if err != nil {
			return err
		}
		if s.squatted {
			b.log.Info("socket broker's address is free again", "container", id)
		}
		s.ln, s.squatted = ln, false
	}
	args := []string{"--listen-fd", strconv.Itoa(brokerListenFD), "--cidr", b.cfg.CIDR.String(),
		"--ip", s.e.IP.Addr().String(), "--cgroup", s.cgroup, "--stats", statsFile(b.cfg.StateDir, id), "--transparent"}
	if b.cfg.Secure {
		// A host socket answers ioctls in the host's namespace: no host
		// sockets for a container that may hold CAP_NET_ADMIN there.
		args = append(args, "--refuse-privileged")
	}
	if err := b.spawn(id, s, args...); err != nil {
		return fmt.Errorf("start broker for %s: %w", id, err)
	}
	return nil
}

// spawn starts skiff-broker with args as id's, in a session of its own
// (it must survive the agent), its log and pid file in the brokers'
// directory, s.ln at brokerListenFD, its end of a new control socket at
// brokerControlFD and the agent's at agentControlFD (kept for a restarted
// agent to take back). The agent's end becomes s.ctl, and the broker gets
// s's seccomp listeners (those its predecessor served).
func (b *Supervisor) spawn(id string, s *brokerSpec, args ...string) error {
	err := os.MkdirAll(b.dir(), 0o700)
	if err == nil {
		err = os.Chmod(b.dir(), 0o700) // an earlier skiff's was 0755
	}
	if err != nil {
		return fmt.Errorf("broker state: %w", err)
	}
	logf, err := os.OpenFile(filepath.Join(b.dir(), id+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("broker log: %w", err)
	}
	defer logf.Close()
	ctl, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("broker control socket: %w", err)
	}
	brokerEnd, agentEnd := os.NewFile(uintptr(ctl[0]), "broker-control"), os.NewFile(uintptr(ctl[1]), "control")
	defer brokerEnd.Close()
	cmd := exec.Command(b.cfg.Binary, append(args, "--control-fd", strconv.Itoa(brokerControlFD))...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{s.ln, brokerEnd, agentEnd} // brokerListenFD (nil: none), brokerControlFD, agentControlFD
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		agentEnd.Close()
		return err
	}
	go cmd.Wait() // reap; the supervisor notices the exit
	if s.ctl != nil {
		s.ctl.Close()
	}
	s.ctl = agentEnd
	s.unsent = append(s.unsent[:0], s.notify...)
	b.sendUnsent(s)
	// Written aside and renamed: a reader (Running, a status request, an
	// agent starting up) never sees the file empty or half written.
	tmp := b.pidFile(id) + ".tmp"
	if err := os.WriteFile(tmp, []byte(strconv.Itoa(cmd.Process.Pid)), 0o600); err != nil {
		return fmt.Errorf("broker pid file: %w", err) // it runs; the supervisor will start another
	}
	if err := os.Rename(tmp, b.pidFile(id)); err != nil {
		return fmt.Errorf("broker pid file: %w", err)
	}
	b.log.Info("socket broker started", "id", id, "pid", cmd.Process.Pid)
	return nil
}

// Running returns the pid of id's broker, or 0.
func (b *Supervisor) Running(id string) int {
	data, err := os.ReadFile(b.pidFile(id))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || !isBroker(pid, id) {
		return 0
	}
	return pid
}

// isBroker checks pid is the broker of container id (pids are reused):
// root's, running a skiff-broker binary (/proc/PID/exe: an unprivileged
// user's process cannot pose as one by its command line alone; " (deleted)"
// after an upgrade replaced the file), with id's command line.
func isBroker(pid int, id string) bool {
	if !rootsProcess(pid) {
		return false
	}
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	if err != nil || filepath.Base(strings.TrimSuffix(exe, " (deleted)")) != "skiff-broker" {
		return false
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil || bytes.Contains(stat, []byte(") Z ")) {
		return false // a zombie is dead
	}
	args := bytes.Split(cmdline, []byte{0})
	if len(args) == 0 || filepath.Base(string(args[0])) != "skiff-broker" {
		return false
	}
	if id == keeperID {
		return slices.ContainsFunc(args, func(a []byte) bool { return string(a) == "--keeper" })
	}
	for i := 1; i+1 < len(args); i++ {
		if string(args[i]) == "--stats" {
			return filepath.Base(string(args[i+1])) == id+".stats"
		}
	}
	return false
}

// rootsProcess reports whether every user id of pid (real, effective,
// saved, filesystem) is root's.
func rootsProcess(pid int) bool {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			f := strings.Fields(rest)
			return len(f) == 4 && f[0] == "0" && f[1] == "0" && f[2] == "0" && f[3] == "0"
		}
	}
	return false
}

// stopBroker ends id's broker if it runs and removes its files.
func stopBroker(stateDir, id string) error {
	b := Supervisor{cfg: Config{StateDir: stateDir}}
	if pid := b.Running(id); pid > 0 {
		if err := syscall.Kill(pid, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("stop broker %d: %w", pid, err)
		}
		// Gone from the container's cgroup before the caller goes on
		// (RemoveEndpoint releases the cgroup): it exits at once on
		// SIGTERM; a broker that does not is killed, and one that does
		// not die within a second (stuck in the kernel) is left to die
		// later: the caller holds the agent's lock.
		killed := false
		for deadline := time.Now().Add(200 * time.Millisecond); isBroker(pid, id); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				if killed {
					return fmt.Errorf("broker %d has not exited a second after SIGKILL", pid)
				}
				syscall.Kill(pid, syscall.SIGKILL)
				killed, deadline = true, time.Now().Add(time.Second)
			}
		}
	}
	for _, ext := range []string{".pid", ".stats", ".log"} {
		os.Remove(filepath.Join(b.dir(), id+ext))
	}
	return nil
}

// Stop ends container id's broker and hands the seccomp listeners it served
// to the keeper.
func (b *Supervisor) Stop(id string) {
	b.mu.Lock()
	var live []*os.File
	if s := b.want[id]; s != nil {
		live = s.close()
	}
	delete(b.want, id)
	b.mu.Unlock()
	// The broker stops first: never two holders of one listener. (One
	// that does not die still lets go of a notification it did not get
	// within a bound: seccomp.c.)
	if err := stopBroker(b.cfg.StateDir, id); err != nil {
		b.log.Warn("stop broker", "container", id, "err", err)
	}
	for _, f := range live { // their processes outlive the broker: the keeper answers them
		b.GiveKeeper(f)
	}
}

// Prune stops brokers of containers that are not local endpoints any more.
func (b *Supervisor) Prune(local []cluster.Endpoint) {
	keep := map[string]bool{}
	for _, e := range local {
		keep[e.ContainerID] = true
	}
	gone := map[string]bool{}
	entries, _ := os.ReadDir(b.dir())
	for _, ent := range entries {
		if id, ok := strings.CutSuffix(ent.Name(), ".pid"); ok && !keep[id] && id != keeperID {
			gone[id] = true
		}
	}
	b.mu.Lock()
	for id := range b.want { // also those whose address was taken: no pid file
		if !keep[id] {
			gone[id] = true
		}
	}
	b.mu.Unlock()
	for id := range gone {
		b.Stop(id)
	}
}

// StopAll ends every broker recorded in stateDir.
func StopAll(stateDir string) error {
	entries, err := os.ReadDir(filepath.Join(stateDir, "brokers"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	var errs []error
	for _, ent := range entries {
		if id, ok := strings.CutSuffix(ent.Name(), ".pid"); ok {
			errs = append(errs, stopBroker(stateDir, id))
		}
	}
	return errors.Join(errs...)
}

// supervise restarts brokers that died (killed, crashed) while their
// container lives. Until one is back, the shim falls back to the overlay.
func (b *Supervisor) supervise() {
	defer close(b.done)
	t := time.NewTicker(superviseEvery)
	defer t.Stop()
	for {
		select {
		case <-b.quit:
			return
		case <-t.C:
		}
		b.mu.Lock()
		if b.keeper != nil {
			b.keeper.dropHung()
			if b.Running(keeperID) == 0 {
				if err := b.startKeeper(); err != nil {
					b.log.Warn("restart the seccomp keeper", "err", err)
				}
			}
			b.sendUnsent(b.keeper)
		}
		for id, s := range b.want {
			s.dropHung()
			b.sendUnsent(s)
			if b.Running(id) > 0 {
				continue
			}
			if ns, err := b.cfg.OpenNetns(s.e); err != nil {
				continue // the container is going; the agent removes it
			} else {
				ns.Close()
			}
			if !s.squatted {
				b.log.Warn("socket broker not running; restarting", "container", id)
			}
			if err := b.start(s); err != nil {
				b.log.Warn("restart broker", "container", id, "err", err)
			}
		}
		b.mu.Unlock()
	}
}

// Close stops supervising; the brokers run on (a restarted agent adopts
// them).
func (b *Supervisor) Close() {
	close(b.quit)
	<-b.done
}
