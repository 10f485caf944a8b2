package bench

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestRunCommandExitCodeAndOutput(t *testing.T) {
	res, err := runCommand(context.Background(), exec.Command("sh", "-c", "echo out; echo err >&2; exit 3"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 3 || string(res.Stdout) != "out\n" || res.Stderr != "err\n" {
		t.Fatalf("res = %+v", res)
	}
}

// A client that outlives its timeout is killed with everything it forked.
func TestRunCommandTimeoutKillsProcessGroup(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "pid")
	cmd := exec.Command("sh", "-c", "sleep 30 & echo $! > "+pidFile+"; wait")
	start := time.Now()
	_, err := runCommand(context.Background(), cmd, 300*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("err = %v, want a timeout", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("timeout took %s", time.Since(start))
	}
	data, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		t.Fatal(err)
	}
	assertGone(t, pid)
}

func TestProcessStop(t *testing.T) {
	p, err := startProcess(exec.Command("sleep", "30"))
	if err != nil {
		t.Fatal(err)
	}
	if p.exited() {
		t.Fatal("exited at once")
	}
	p.stop()
	if !p.exited() || !strings.Contains(p.describeExit(), "signal: terminated") {
		t.Fatalf("after stop: exited=%v, %s", p.exited(), p.describeExit())
	}
	p.stop() // stopping twice is harmless
}

// assertGone waits for pid to disappear (it is reaped by init once killed).
func assertGone(t *testing.T, pid int) {
	t.Helper()
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil || strings.Contains(string(data), ") Z ") {
			return
		}
	}
	t.Errorf("process %d survived its group's kill", pid)
}

func TestTailBuffer(t *testing.T) {
	b := &tailBuffer{max: 8}
	b.Write([]byte("hello "))
	b.Write([]byte("world!"))
	if got := b.String(); got != "o world!" {
		t.Fatalf("tail = %q", got)
	}
	if got := lastLines("a\nb\nc\nd\n", 2); got != "c | d" {
		t.Fatalf("lastLines = %q", got)
	}
}
