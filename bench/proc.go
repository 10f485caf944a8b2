package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// stopGrace is how long a stopped process gets between SIGTERM and SIGKILL.
const stopGrace = 3 * time.Second

// process is a started command running in its own process group, so that
// it and everything it forks can be signalled together by PID.
type process struct {
	cmd    *exec.Cmd
	stdout *bytes.Buffer
	stderr *tailBuffer
	done   chan struct{} // closed once Wait returned
	err    error         // Wait's result, valid after done
}

// startProcess starts cmd in a new process group, capturing stdout and the
// tail of stderr.
func startProcess(cmd *exec.Cmd) (*process, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	if !cmd.SysProcAttr.Setsid { // a session leader already leads its own group
		cmd.SysProcAttr.Setpgid = true
		cmd.SysProcAttr.Pgid = 0
	}
	cmd.WaitDelay = stopGrace
	p := &process{cmd: cmd, stdout: &bytes.Buffer{}, stderr: &tailBuffer{max: 4096}, done: make(chan struct{})}
	cmd.Stdout = p.stdout
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// signal sends sig to the process group (pgid == pid thanks to Setpgid).
func (p *process) signal(sig syscall.Signal) {
	_ = syscall.Kill(-p.cmd.Process.Pid, sig) // ESRCH: already gone
}

// stop terminates the process group and waits for the leader to exit:
// SIGTERM, then SIGKILL after stopGrace. The group is signalled even when
// the leader has already exited, to reap anything it left behind.
func (p *process) stop() {
	p.signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(stopGrace):
	}
	p.signal(syscall.SIGKILL)
	<-p.done
}

// exited reports whether the process has exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// describeExit explains how the process ended, with the tail of its stderr.
func (p *process) describeExit() string {
	msg := "exited"
	if p.err != nil {
		msg = p.err.Error()
	}
	if tail := strings.TrimSpace(p.stderr.String()); tail != "" {
		msg += ": " + lastLines(tail, 3)
	}
	return msg
}

// commandResult is the outcome of a command run to completion.
type commandResult struct {
	Stdout   []byte
	Stderr   string
	ExitCode int
}

// runCommand runs cmd to completion, killing its process group when ctx is
// done or timeout passes. A non-zero exit is not an error here: the caller
// decides from ExitCode and the output.
func runCommand(ctx context.Context, cmd *exec.Cmd, timeout time.Duration) (commandResult, error) {
	p, err := startProcess(cmd)
	if err != nil {
		return commandResult{}, err
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-p.done:
	case <-ctx.Done():
		p.stop()
		return commandResult{}, fmt.Errorf("%s: %w", cmd.Path, ctx.Err())
	case <-timer.C:
		p.stop()
		return commandResult{}, fmt.Errorf("%s: no result after %s, killed", cmd.Path, timeout)
	}
	p.signal(syscall.SIGKILL) // stray children of a finished client
	res := commandResult{Stdout: p.stdout.Bytes(), Stderr: p.stderr.String()}
	var exitErr *exec.ExitError
	switch {
	case p.err == nil:
	case errors.As(p.err, &exitErr):
		res.ExitCode = exitErr.ExitCode()
	default:
		return res, fmt.Errorf("wait %s: %w", cmd.Path, p.err)
	}
	return res, nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (t *tailBuffer) Write(b []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, b...)
	if over := len(t.buf) - t.max; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(b), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// lastLines returns the last n lines of s joined with " | ".
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
