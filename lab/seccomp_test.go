package lab

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/api"
)

// The seccomp agent: programs without the shim (a static Go server and
// client built here, busybox-static, a dynamically linked program not
// preloaded) get host sockets through skiff's seccomp filter, their
// listener handed to skiffd as a runtime hands it (skiff-seccomp-exec; a
// real runc below).

// buildSeccompApp builds testdata/seccompapp, static, into dir.
func buildSeccompApp(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(dir, "seccompapp")
	cmd := exec.Command("go", "build", "-o", out, "./testdata/seccompapp")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build seccompapp: %v\n%s", err, b)
	}
	return out
}

// seccompOf is target's seccomp counters, as its host reports them.
func seccompOf(t *testing.T, l *Lab, target string) api.SocketsSeccomp {
	t.Helper()
	c, err := l.Container(target)
	if err != nil {
		t.Fatal(err)
	}
	for _, sc := range socketsStatus(t, l, c.Host).Containers {
		if sc.IP == c.IP.String() {
			return sc.Seccomp
		}
	}
	t.Fatalf("%s (%s) is not in %s's sockets status", target, c.IP, c.Host)
	return api.SocketsSeccomp{}
}

// seccompServer starts a server under the filter in target and waits for
// its replaced listener and the client's route to it.
func seccompServer(t *testing.T, l *Lab, target, client string, port uint16, prog string, args ...string) *proc {
	t.Helper()
	cmd, err := l.SeccompCommand(context.Background(), target, prog, args...)
	if err != nil {
		t.Fatal(err)
	}
	appEnv(cmd, false)
	p := startProc(t, cmd, false)
	ip, _ := l.IP(target)
	c, _ := l.Container(target)
	ap := netip.AddrPortFrom(ip, port)
	waitListener(t, l, c.Host, ap, p.exited)
	appWaitRoute(t, l, client, ap, 10*time.Second)
	return p
}

// seccompRun runs prog under the filter in target and returns its stdout.
func seccompRun(t *testing.T, l *Lab, target string, timeout time.Duration, prog string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd, err := l.SeccompCommand(ctx, target, prog, args...)
	if err != nil {
		t.Fatal(err)
	}
	appEnv(cmd, false)
	var stdout, stderr appBuf
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 2 * time.Second
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s in %s: %v\nstdout:\n%s\nstderr:\n%s", filepath.Base(prog), strings.Join(args, " "), target, err,
			tail([]byte(stdout.String()), 2000), tail([]byte(stderr.String()), 2000))
	}
	return stdout.String()
}

// fastBoth checks that a run moved the fast path's counters on both hosts
// and the seccomp agent's on both containers.
func fastBoth(t *testing.T, l *Lab, server, client string, run func()) {
	t.Helper()
	sc, _ := l.Container(server)
	cc, _ := l.Container(client)
	before := map[string]map[string]uint64{sc.Host: appCounters(t, l, sc.Host), cc.Host: appCounters(t, l, cc.Host)}
	cs := seccompOf(t, l, client)
	run()
	if d := appDeltas(before[cc.Host], appCounters(t, l, cc.Host)); d["connect_fast"] == 0 {
		t.Errorf("connect_fast on %s did not move: the client did not take the fast path (%s)", cc.Host, appFormat(d))
	}
	if d := appDeltas(before[sc.Host], appCounters(t, l, sc.Host)); d["assigned"] == 0 {
		t.Errorf("assigned on %s did not move: the replaced listener took no fast-path SYN (%s)", sc.Host, appFormat(d))
	}
	if now := seccompOf(t, l, client); now.Replaced == cs.Replaced {
		t.Errorf("the client's seccomp replaced count did not move: %+v", now)
	}
}

func TestSocketsSeccomp(t *testing.T) {
	l := newLab(t, Config{Name: "sksc", Hosts: 2, ContainersPerHost: 1, Mode: "sockets"})
	const server, client = "h1/c1", "h2/c1"
	sip, _ := l.IP(server)
	appWaitBroker(t, l, server, 10*time.Second)
	appWaitBroker(t, l, client, 10*time.Second)
	t.Cleanup(func() {
		if t.Failed() {
			for _, target := range []string{server, client} {
				c, _ := l.Container(target)
				log, _ := os.ReadFile(filepath.Join(l.hostDir(c.Host), "state", "brokers", c.ID+".log"))
				t.Logf("broker log of %s:\n%s", target, tail(log, 3000))
			}
		}
	})
	dir := appTempDir(t, "sksc-")
	app := buildSeccompApp(t, dir)
	blob := filepath.Join(dir, "blob.bin")
	want := appRandomFile(t, blob, 1<<20)

	t.Run("go", func(t *testing.T) {
		seccompServer(t, l, server, client, 8080, app, "serve", "0.0.0.0:8080", blob)
		if s := seccompOf(t, l, server); s.Replaced == 0 || s.Listeners == 0 {
			t.Errorf("server's listen not replaced by the seccomp agent: %+v", s)
		}
		fastBoth(t, l, server, client, func() {
			out := seccompRun(t, l, client, 20*time.Second, app, "get", fmt.Sprintf("http://%s:8080/blob", sip))
			if got := strings.Fields(out); len(got) != 2 || got[0] != want || got[1] != "1048576" {
				t.Errorf("static Go client got %q, want %s 1048576", out, want)
			}
		})
	})
}
