package broker

import (
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

func TestReadStats(t *testing.T) {
	dir := t.TempDir()
	if st := ReadStats(dir, "c"); st != (Stats{}) {
		t.Fatalf("counters from a missing file: %+v", st)
	}
	data := make([]byte, 72)
	// SKIFF_STATS_MAGIC of skiff_broker.h: "SKST", layout 2.
	for i, v := range []uint64{0x54534b53 | 2<<32, 16, 3, 1, 2, 1, 0, 4242, 77} {
		binary.NativeEndian.PutUint64(data[8*i:], v)
	}
	if err := os.MkdirAll(filepath.Dir(statsFile(dir, "c")), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(statsFile(dir, "c"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	if st := ReadStats(dir, "c"); st != (Stats{HandedOut: 16, Replaced: 3, Fallback: 1, Privileged: 77}) {
		t.Fatalf("counters %+v, want 16, 3, 1, privileged 77", st)
	}
	// layout 3: the seccomp agent's counters follow
	data = append(data, make([]byte, 7*8)...)
	binary.NativeEndian.PutUint64(data, 0x54534b53|3<<32)
	for i, v := range []uint64{2, 10, 3, 4, 1, 5000, 18} {
		binary.NativeEndian.PutUint64(data[8*(9+i):], v)
	}
	if err := os.WriteFile(statsFile(dir, "c"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	want := Stats{HandedOut: 16, Replaced: 3, Fallback: 1, Privileged: 77,
		Seccomp: SeccompStats{Listeners: 2, Replaced: 10, Fallback: 3, Passed: 4, Dropped: 1, Nanos: 5000, Handled: 18}}
	if st := ReadStats(dir, "c"); st != want {
		t.Fatalf("counters %+v, want %+v", st, want)
	}
	data[0] = 0 // a broker still starting up
	if err := os.WriteFile(statsFile(dir, "c"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	if st := ReadStats(dir, "c"); st != (Stats{}) {
		t.Fatalf("counters from a file without the magic: %+v", st)
	}
}

// TestIsBroker: a broker is recognised by its command line, its binary
// (/proc/PID/exe) and its owner (root): a process named skiff-broker by
// its command line only, or run by another user, is not one.
func TestIsBroker(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	dir := t.TempDir()
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "skiff-broker") // a shell under the broker's name
	data, err := os.ReadFile("/bin/sh")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	start := func(name string, args ...string) int {
		cmd := exec.Command(name, args...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd.Process.Pid
	}
	flags := []string{"-c", "sleep 30; true", "x", "--stats", "/x/c1.stats"}
	cases := map[string]struct {
		pid  int
		want bool
	}{
		"root's skiff-broker":            {start(bin, flags...), true},
		"named by its command line only": {start("bash", "-c", `exec -a skiff-broker sh "$@"`, "bash", "-c", "sleep 30; true", "x", "--stats", "/x/c1.stats"), false},
		"another user's":                 {start("setpriv", append([]string{"--reuid=65534", "--regid=65534", "--clear-groups", bin}, flags...)...), false},
	}
	time.Sleep(200 * time.Millisecond) // the execs done
	for name, c := range cases {
		if got := isBroker(c.pid, "c1"); got != c.want {
			cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", c.pid))
			t.Errorf("%s (%q): isBroker %v, want %v", name, cmdline, got, c.want)
		}
	}
}
