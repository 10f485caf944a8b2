package lab

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// spawn starts a long-running lab process (etcd, an agent) inside a network
// namespace, in its own session so it outlives the command that started it,
// with its output in logFile. nsenter, not ip netns exec: the latter mounts a
// private /sys, hiding the machine's bpffs where agents pin their maps.
func (l *Lab) spawn(netns, logFile, bin string, args ...string) (int, error) {
	log, err := os.OpenFile(logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return 0, err
	}
	defer log.Close()
	cmd := exec.Command("nsenter", append([]string{"--net=" + NetnsPath(netns), "--", bin}, args...)...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	// Reap it when it exits, if this process is still around (tests).
	go cmd.Wait()
	return cmd.Process.Pid, nil
}

// alive reports whether pid runs and is not a zombie.
func alive(pid int) bool {
	if pid <= 0 {
		return false
	}
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// The state follows the parenthesised command name.
	s := string(stat)
	i := strings.LastIndexByte(s, ')')
	return i > 0 && i+2 < len(s) && s[i+2] != 'Z'
}

// stop sends SIGTERM, waits up to grace, then SIGKILLs.
func stop(ctx context.Context, pid int, grace time.Duration) error {
	if !alive(pid) {
		return nil
	}
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("signal %d: %w", pid, err)
	}
	deadline := time.Now().Add(grace)
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			deadline = time.Now().Add(grace)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

// StopAgent stops a host's agent; the host's data plane stays.
func (l *Lab) StopAgent(ctx context.Context, host string) error {
	h, err := l.Host(host)
	if err != nil {
		return err
	}
	return stop(ctx, h.AgentPID, 5*time.Second)
}

// StartAgent starts a host's agent and waits until it is ready.
func (l *Lab) StartAgent(ctx context.Context, host string) error {
	h, err := l.Host(host)
	if err != nil {
		return err
	}
	if alive(h.AgentPID) {
		return fmt.Errorf("agent on %s already runs (pid %d)", host, h.AgentPID)
	}
	if err := l.startAgent(h); err != nil {
		return err
	}
	if err := l.save(); err != nil {
		return err
	}
	return l.waitAgent(ctx, *h, 30*time.Second)
}

// StopEtcd stops every member of the cluster store (to test an
// unreachable store).
func (l *Lab) StopEtcd(ctx context.Context) error {
	var errs []error
	for _, m := range l.Etcd {
		errs = append(errs, stop(ctx, m.PID, 5*time.Second))
	}
	return errors.Join(errs...)
}

// StartEtcd restarts the members of the cluster store that are not
// running, on their existing data.
func (l *Lab) StartEtcd() error {
	for i := range l.Etcd {
		if alive(l.Etcd[i].PID) {
			continue
		}
		if err := l.startMember(&l.Etcd[i]); err != nil {
			return err
		}
	}
	return l.save()
}
