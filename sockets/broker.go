package sockets

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/skiffnet/skiff/cluster"
)

// brokers runs one skiff-broker per replaced container and restarts any
// that dies. A broker runs in the host namespace and in the container's
// cgroup (the cgroup a socket is created in selects its hooks) and serves
// the container at an abstract Unix address inside the container's
// namespace. Brokers outlive the agent: a restarted agent adopts them by
// their pid files.
type brokers struct {
	cfg  Config
	log  *slog.Logger
	mu   sync.Mutex
	want map[string]brokerSpec // by container ID
	quit chan struct{}
	done chan struct{}
}

type brokerSpec struct {
	e      cluster.Endpoint
	cgroup string
}

// superviseEvery is how often dead brokers are looked for.
const superviseEvery = 200 * time.Millisecond

func newBrokers(cfg Config, log *slog.Logger) *brokers {
	b := &brokers{cfg: cfg, log: log, want: map[string]brokerSpec{}, quit: make(chan struct{}), done: make(chan struct{})}
	go b.supervise()
	return b
}

func (b *brokers) dir() string { return filepath.Join(b.cfg.StateDir, "brokers") }
func (b *brokers) pidFile(id string) string {
	return filepath.Join(b.dir(), id+".pid")
}

// StatsFile is where a container's broker keeps its counters.
func StatsFile(stateDir, containerID string) string {
	return filepath.Join(stateDir, "brokers", containerID+".stats")
}

// BrokerStats are a broker's counters. Replaced and fallback are what its
// shims reported, flushed with their next request or at exit.
type BrokerStats struct {
	HandedOut uint64 // host sockets sent to the container's processes
	Replaced  uint64 // connections and listeners on host sockets
	Fallback  uint64 // sockets that fell back to the overlay
}

// brokerStatsMagic opens a ready broker's counters file: "SKST", layout 1
// (shim/skiff_broker.h).
const brokerStatsMagic = 0x154534b53

// ReadBrokerStats reads a container's broker counters; zero while the
// broker is not (or not yet) running.
func ReadBrokerStats(stateDir, containerID string) BrokerStats {
	data, err := os.ReadFile(StatsFile(stateDir, containerID))
	if err != nil || len(data) < 32 || binary.NativeEndian.Uint64(data) != brokerStatsMagic {
		return BrokerStats{}
	}
	u := func(i int) uint64 { return binary.NativeEndian.Uint64(data[8*i:]) }
	return BrokerStats{HandedOut: u(1), Replaced: u(2), Fallback: u(3)}
}

// ensure starts e's broker unless it runs.
func (b *brokers) ensure(e cluster.Endpoint, cgroup string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.want[e.ContainerID] = brokerSpec{e, cgroup}
	if pid := b.running(e.ContainerID); pid > 0 {
		return nil
	}
	return b.start(brokerSpec{e, cgroup})
}

func (b *brokers) start(s brokerSpec) error {
	if err := os.MkdirAll(b.dir(), 0o755); err != nil {
		return fmt.Errorf("broker state: %w", err)
	}
	id := s.e.ContainerID
	logf, err := os.OpenFile(filepath.Join(b.dir(), id+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("broker log: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(b.cfg.Broker, "--netns", s.e.Netns, "--cidr", b.cfg.Cluster.CIDR.String(),
		"--ip", s.e.IP.Addr().String(), "--cgroup", s.cgroup, "--stats", StatsFile(b.cfg.StateDir, id), "--transparent")
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own session: the broker must survive the agent.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start broker for %s: %w", id, err)
	}
	go cmd.Wait() // reap; the supervisor notices the exit
	if err := os.WriteFile(b.pidFile(id), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		return fmt.Errorf("broker pid file: %w", err)
	}
	b.log.Info("socket broker started", "container", id, "pid", cmd.Process.Pid)
	return nil
}

// running returns the pid of id's broker, or 0.
func (b *brokers) running(id string) int {
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

// isBroker checks pid is the broker of container id (pids are reused).
func isBroker(pid int, id string) bool {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil || bytes.Contains(stat, []byte(") Z ")) {
		return false // a zombie is dead
	}
	args := bytes.Split(cmdline, []byte{0})
	return len(args) > 0 && filepath.Base(string(args[0])) == "skiff-broker" &&
		bytes.Contains(cmdline, []byte("/"+id+".stats"))
}

// stopBroker ends id's broker if it runs and removes its files.
func stopBroker(stateDir, id string) error {
	b := brokers{cfg: Config{StateDir: stateDir}}
	if pid := b.running(id); pid > 0 {
		if err := syscall.Kill(pid, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("stop broker %d: %w", pid, err)
		}
	}
	for _, ext := range []string{".pid", ".stats", ".log"} {
		os.Remove(filepath.Join(b.dir(), id+ext))
	}
	return nil
}

func (b *brokers) stop(id string) {
	b.mu.Lock()
	delete(b.want, id)
	b.mu.Unlock()
	if err := stopBroker(b.cfg.StateDir, id); err != nil {
		b.log.Warn("stop broker", "container", id, "err", err)
	}
}

// prune stops brokers of containers that are not local endpoints any more.
func (b *brokers) prune(local []cluster.Endpoint) {
	keep := map[string]bool{}
	for _, e := range local {
		keep[e.ContainerID] = true
	}
	entries, _ := os.ReadDir(b.dir())
	for _, ent := range entries {
		if id, ok := strings.CutSuffix(ent.Name(), ".pid"); ok && !keep[id] {
			b.stop(id)
		}
	}
}

// stopAllBrokers ends every broker recorded in stateDir.
func stopAllBrokers(stateDir string) error {
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
func (b *brokers) supervise() {
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
		for id, s := range b.want {
			if b.running(id) > 0 {
				continue
			}
			if _, err := os.Stat(s.e.Netns); err != nil {
				continue // the container is going; the agent removes it
			}
			b.log.Warn("socket broker not running; restarting", "container", id)
			if err := b.start(s); err != nil {
				b.log.Warn("restart broker", "container", id, "err", err)
			}
		}
		b.mu.Unlock()
	}
}

// BrokerRunning reports whether the container's broker runs.
func (l *Layer) BrokerRunning(containerID string) bool { return l.brokers.running(containerID) > 0 }

func (b *brokers) close() {
	close(b.quit)
	<-b.done
}
