package lab

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/sockets"
	"github.com/skiffnet/skiff/sockets/broker/seccomp"
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
func seccompOf(t *testing.T, l *Lab, target string) sockets.ContainerSeccomp {
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
	return sockets.ContainerSeccomp{}
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

// seccompLab brings up a sockets lab of two hosts with a container each
// (server h1/c1, client h2/c1), builds seccompapp into a directory of the
// test's and starts its echo server under the filter in h1/c1, port 7000.
// The brokers' logs go to the test's log if it fails.
func seccompLab(t *testing.T, name string) (l *Lab, dir, app string, echo netip.AddrPort) {
	t.Helper()
	const server, client = "h1/c1", "h2/c1"
	l = newLab(t, Config{Name: name, Hosts: 2, ContainersPerHost: 1, Mode: "sockets"})
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
	dir = appTempDir(t, name+"-")
	app = buildSeccompApp(t, dir)
	sip, _ := l.IP(server)
	echo = netip.AddrPortFrom(sip, 7000)
	seccompServer(t, l, server, client, 7000, app, "echo", echo.String())
	return l, dir, app, echo
}

func TestSocketsSeccomp(t *testing.T) {
	const server, client = "h1/c1", "h2/c1"
	l, dir, app, echo := seccompLab(t, "sksc")
	sip := echo.Addr()
	blob := filepath.Join(dir, "blob.bin")
	want := appRandomFile(t, blob, 1<<20)
	seccompServer(t, l, server, client, 8080, app, "serve", "0.0.0.0:8080", blob)

	t.Run("go", func(t *testing.T) {
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

	t.Run("busybox", func(t *testing.T) {
		// h2 serves, h1 fetches: the other direction
		bb := filepath.Join(dir, "busybox")
		if out, err := exec.Command("cp", "/bin/busybox", bb).CombinedOutput(); err != nil {
			t.Fatalf("busybox-static (make deps installs it): %v %s", err, out)
		}
		www := filepath.Join(dir, "www")
		os.MkdirAll(www, 0o755)
		if err := os.Link(blob, filepath.Join(www, "blob")); err != nil {
			t.Fatal(err)
		}
		cip, _ := l.IP(client)
		seccompServer(t, l, client, server, 8081, bb, "httpd", "-f", "-p", "0.0.0.0:8081", "-h", www)
		fastBoth(t, l, client, server, func() {
			out := seccompRun(t, l, server, 20*time.Second, bb, "wget", "-q", "-O", "-", fmt.Sprintf("http://%s:8081/blob", cip))
			if got := appSHA([]byte(out)); got != want {
				t.Errorf("busybox wget: sha256 %s (%d bytes), want %s", got, len(out), want)
			}
		})
	})

	t.Run("dynamic", func(t *testing.T) {
		// not preloaded: curl (non-blocking connect, poll) to the Go server
		curl := appTool(t, "curl")
		fastBoth(t, l, server, client, func() {
			out := seccompRun(t, l, client, 20*time.Second, curl, "-sS", "--fail", "--noproxy", "*", "--max-time", "10", "-o", "-",
				fmt.Sprintf("http://%s:8080/blob", sip))
			if got := appSHA([]byte(out)); got != want {
				t.Errorf("curl: sha256 %s (%d bytes), want %s", got, len(out), want)
			}
		})
	})

	t.Run("security", func(t *testing.T) {
		// the sockets layer's probe, for a program the seccomp agent serves
		srv := echo
		out := seccompRun(t, l, client, 30*time.Second, "python3", "-c", pySecurity, sip.String(), "7000", l.Hosts[0].UnderlayIP.String())
		var got map[string]string
		if err := json.Unmarshal([]byte(out), &got); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		cip, _ := l.IP(client)
		for k, v := range securityWant(cip, srv) {
			if strings.HasPrefix(k, "raw_") {
				continue // a socket() is the container's own: what the overlay allows
			}
			if got[k] != v {
				t.Errorf("%s = %q, want %q", k, got[k], v)
			}
		}
		if t.Failed() {
			t.Logf("probe output: %s", out)
		}
		// an option the fast path refuses, set before connect: the
		// program keeps its own socket, option and all (the overlay)
		before := seccompOf(t, l, client)
		if out := seccompRun(t, l, client, 20*time.Second, "python3", "-c", pyTOSFirst, sip.String(), "7000"); strings.TrimSpace(out) != "ok 16" {
			t.Errorf("IP_TOS before connect: %q, want ok 16", out)
		}
		if after := seccompOf(t, l, client); after.Fallback == before.Fallback || after.Replaced != before.Replaced {
			t.Errorf("a socket with IP_TOS was swapped: %+v then %+v", before, after)
		}
		// a live connection the policy then denies ends
		cmd, err := l.SeccompCommand(context.Background(), client, app, "hold", srv.String())
		if err != nil {
			t.Fatal(err)
		}
		hold := startProc(t, cmd, true)
		if line := hold.line(t, 10*time.Second); !strings.HasPrefix(line, "connected") {
			t.Fatalf("hold: %q", line)
		}
		denyEnds(t, l, hold, sip)
		if err := l.DeletePolicy(context.Background(), "cut"); err != nil {
			t.Fatal(err)
		}
		// Watch-triggered reconciles are paced (100 ms): the rule's
		// removal lands within that, not at once.
		if _, err := eventually(converges, func() error { return roundTrips(l, client, "tcp4", echo, 1) }); err != nil {
			t.Fatalf("after the rule went: %v", err)
		}
	})

	t.Run("short connections", func(t *testing.T) {
		// 10 000 sequential connections from the static client, none stalled
		before := seccompOf(t, l, client)
		out := strings.Fields(seccompRun(t, l, client, 5*time.Minute, app, "loop", echo.String(), "10000"))
		if len(out) != 4 || out[0] != "ok" {
			t.Fatalf("loop: %v", out)
		}
		if ms, _ := strconv.ParseFloat(out[3], 64); ms >= 500 {
			t.Errorf("the slowest of 10000 connections took %.1f ms", ms)
		}
		after := seccompOf(t, l, client)
		if n := after.Replaced - before.Replaced; n < 10000 {
			t.Errorf("%d of 10000 connections replaced by the seccomp agent", n)
		}
		t.Logf("10000 connections: slowest %s ms; the agent's mean answer %.1f µs", out[3], after.MeanMicros)
	})

	t.Run("runc", func(t *testing.T) {
		// Debian's runc with skiff's profile: it hands the listener over
		runc := appTool(t, "runc")
		root := filepath.Join(dir, "runc")
		srv := netip.AddrPortFrom(sip, 8090)
		server := runcContainer(t, l, runc, root, "h1/c1", dir, app, "serve", srv.String(), "/blob")
		sp := startProc(t, server, false)
		waitListener(t, l, "h1", srv, sp.exited)
		appWaitRoute(t, l, client, srv, 10*time.Second)
		if s := seccompOf(t, l, "h1/c1"); s.Listeners == 0 {
			t.Errorf("runc's listener did not reach h1/c1's broker: %+v", s)
		}
		fastBoth(t, l, "h1/c1", client, func() {
			cmd := runcContainer(t, l, runc, root, client, dir, app, "get", fmt.Sprintf("http://%s/blob", srv))
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("runc client: %v %s", err, out)
			}
			if got := strings.Fields(string(out)); len(got) != 2 || got[0] != want {
				t.Errorf("client in runc got %q, want %s", out, want)
			}
		})
	})
}

// runcContainer returns a `runc run` of a bundle the test builds: a
// rootfs of busybox-static, app and the blob, in target's network
// namespace and in a cgroup below target's, under skiff's seccomp profile
// with the listener target's host takes. The container is deleted when the
// test ends.
func runcContainer(t *testing.T, l *Lab, runc, root, target, dir, app string, args ...string) *exec.Cmd {
	t.Helper()
	c, err := l.Container(target)
	if err != nil {
		t.Fatal(err)
	}
	id := fmt.Sprintf("sksc-%s-%d", strings.ReplaceAll(target, "/", "-"), time.Now().UnixNano()%1e9)
	bundle := filepath.Join(dir, id)
	bin := filepath.Join(bundle, "rootfs", "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	for src, dst := range map[string]string{"/bin/busybox": bin + "/busybox", app: bin + "/app", filepath.Join(dir, "blob.bin"): bundle + "/rootfs/blob"} {
		if out, err := exec.Command("cp", src, dst).CombinedOutput(); err != nil {
			t.Fatalf("%v %s", err, out)
		}
	}
	if out, err := exec.Command(runc, "spec", "--bundle", bundle).CombinedOutput(); err != nil {
		t.Fatalf("runc spec: %v %s", err, out)
	}
	var spec map[string]any
	data, _ := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	base, _ := seccomp.LoadBase("none")
	profile, err := seccomp.Build(base, l.SeccompSocket(c.Host))
	if err != nil {
		t.Fatal(err)
	}
	cgroups, err := cgroup.Root()
	if err != nil {
		t.Fatal(err)
	}
	proc := spec["process"].(map[string]any)
	proc["terminal"] = false
	proc["args"] = append([]any{"/bin/app"}, anySlice(args)...)
	linux := spec["linux"].(map[string]any)
	linux["seccomp"] = profile
	linux["cgroupsPath"] = filepath.Join(strings.TrimPrefix(c.Cgroup, cgroups), id)
	for _, ns := range linux["namespaces"].([]any) {
		if m := ns.(map[string]any); m["type"] == "network" {
			m["path"] = NetnsPath(c.Netns)
		}
	}
	data, _ = json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { exec.Command(runc, "--root", root, "delete", "--force", id).Run() })
	return exec.Command(runc, "--root", root, "run", "--bundle", bundle, id)
}

func anySlice(s []string) []any {
	a := make([]any, len(s))
	for i, v := range s {
		a[i] = v
	}
	return a
}

// pyTOSFirst sets IP_TOS, connects, echoes a byte and prints "ok" and the
// TOS the socket has.
const pyTOSFirst = `
import socket, sys
s = socket.socket()
s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 16)
s.settimeout(5)
s.connect((sys.argv[1], int(sys.argv[2])))
s.sendall(b"x")
print("ok" if s.recv(1) == b"x" else "bad", s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS))
`

// pyEpollFirst connects a socket it registered in an epoll before
// connect() (as nginx's upstreams do), waits for it there and echoes a
// line: a swap would lose the registration and hang it.
const pyEpollFirst = `
import select, socket, sys
s = socket.socket()
s.setblocking(False)
ep = select.epoll()
ep.register(s.fileno(), select.EPOLLOUT)
s.connect_ex((sys.argv[1], int(sys.argv[2])))
if not ep.poll(5):
    print("hung"); sys.exit(1)
s.setblocking(True)
s.settimeout(5)
s.sendall(b"x")
print("ok" if s.recv(1) == b"x" else "bad")
`

// TestSocketsSeccompFaults: the seccomp agent's faults. A broker killed
// while a client connects in a loop is restarted and given the client's
// listener again, without an error or a stall; so after skiffd restarted
// (which takes the listeners back from the broker); with skiffd down a new
// program does not start, a running one is served on; a process whose
// listener was handed over as another container's gets nothing of that
// container; a preloaded process is served by its shim only; an
// epoll-registered socket stays the container's; a notification whose
// caller died is dropped, the broker serving on.
func TestSocketsSeccompFaults(t *testing.T) {
	const client = "h2/c1"
	l, _, app, echo := seccompLab(t, "skscf")
	sip := echo.Addr()

	// loop runs n connections from the client while during() runs.
	loop := func(t *testing.T, n, pauseMS int, during func()) {
		t.Helper()
		cmd, err := l.SeccompCommand(context.Background(), client, app, "loop", echo.String(), strconv.Itoa(n), strconv.Itoa(pauseMS))
		if err != nil {
			t.Fatal(err)
		}
		p := startProc(t, cmd, false)
		time.Sleep(300 * time.Millisecond)
		during()
		if err := p.wait(2 * time.Minute); err != nil {
			t.Fatalf("the loop failed: %v", err)
		}
		out := strings.Fields(p.out.String())
		if len(out) < 4 || out[0] != "ok" {
			t.Fatalf("loop: %v", out)
		}
		if ms, _ := strconv.ParseFloat(out[3], 64); ms >= 1000 {
			t.Errorf("the slowest connection took %.1f ms", ms)
		}
		t.Logf("%d connections: slowest %s ms", n, out[3])
	}
	killBroker := func(t *testing.T) {
		t.Helper()
		old := brokerPID(t, l, client)
		syscall.Kill(old, syscall.SIGKILL)
		if _, err := eventually(5*time.Second, func() error {
			if b := seccompOf(t, l, client); b.Listeners == 0 || brokerPID(t, l, client) == old {
				return fmt.Errorf("no new broker with the listener yet (%+v)", b)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("broker killed", func(t *testing.T) {
		loop(t, 3000, 0, func() { killBroker(t) })
		if s := seccompOf(t, l, client); s.Replaced == 0 {
			t.Errorf("the new broker replaced nothing: %+v", s)
		}
	})

	t.Run("skiffd restarted", func(t *testing.T) {
		loop(t, 1000, 10, func() { // 10 s or more
			if err := l.StopAgent(context.Background(), "h2"); err != nil {
				t.Fatal(err)
			}
			// skiffd down: a new program does not start; running ones are served
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			cmd, err := l.SeccompCommand(ctx, client, app, "get", "http://"+echo.String()+"/")
			if err != nil {
				t.Fatal(err)
			}
			if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "failed to connect with seccomp agent") {
				t.Errorf("a program started with skiffd down: %v %s", err, out)
			}
			if err := l.StartAgent(context.Background(), "h2"); err != nil {
				t.Fatal(err)
			}
			appWaitBroker(t, l, client, 10*time.Second)
			// the restarted skiffd took the broker's control socket back:
			// a new program's listener reaches the running broker
			cmd, err = l.SeccompCommand(context.Background(), client, app, "hold", echo.String())
			if err != nil {
				t.Fatal(err)
			}
			hold := startProc(t, cmd, true)
			hold.line(t, 10*time.Second)
			if sc := seccompOf(t, l, client); sc.Listeners < 2 {
				t.Errorf("the running broker did not get the listener of a program started after skiffd's restart: %+v", sc)
			}
			hold.cmd.Process.Kill()
			killBroker(t) // the restarted skiffd gives the next broker the listener
		})
	})

	t.Run("keeper", func(t *testing.T) {
		// a process of no container (h2's own namespace) under the filter:
		// the keeper continues its calls, also across a skiffd restart
		h, _ := l.Host("h2")
		cmd := exec.Command("ip", "netns", "exec", h.Netns, filepath.Join(l.Config.BinDir, "skiff-seccomp-exec"),
			"--filter", filepath.Join(l.dir(), "seccomp.bpf"), "--socket", l.SeccompSocket("h2"), "--id", "host-process", "--",
			app, "loop", echo.String(), "600", "10")
		p := startProc(t, cmd, false)
		time.Sleep(500 * time.Millisecond)
		if err := l.StopAgent(context.Background(), "h2"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second)
		if err := l.StartAgent(context.Background(), "h2"); err != nil {
			t.Fatal(err)
		}
		if err := p.wait(time.Minute); err != nil {
			t.Fatalf("a host process's loop across a skiffd restart: %v", err)
		}
		if out := p.out.String(); !strings.HasPrefix(out, "ok 600") {
			t.Errorf("loop: %q", out)
		}
		appWaitBroker(t, l, client, 10*time.Second)
	})

	t.Run("foreign listener", func(t *testing.T) {
		// a process of h2/c2 hands its listener over as h2/c1's
		other, err := l.AddContainer(context.Background(), "h2")
		if err != nil {
			t.Fatal(err)
		}
		appWaitBroker(t, l, other, 10*time.Second)
		hold, err := l.SeccompCommand(context.Background(), client, app, "hold", echo.String())
		if err != nil {
			t.Fatal(err)
		}
		h := startProc(t, hold, true)
		h.line(t, 10*time.Second)
		before, fast := seccompOf(t, l, client), appCounters(t, l, "h2")["connect_fast"]
		oc, _ := l.Container(other)
		cmd, err := l.SeccompCommand(context.Background(), other, app, "loop", echo.String(), "20")
		if err != nil {
			t.Fatal(err)
		}
		for i, a := range cmd.Args {
			if a == oc.ID && cmd.Args[i-1] == "--id" {
				cmd.Args = slices.Insert(cmd.Args, i+1, "--pid", strconv.Itoa(h.pid()))
				break
			}
		}
		if out, err := cmd.CombinedOutput(); err != nil || !strings.HasPrefix(string(out), "ok 20") {
			t.Fatalf("the other container's loop: %v %s", err, out)
		}
		after := seccompOf(t, l, client)
		if after.Replaced != before.Replaced || after.Passed < before.Passed+20 {
			t.Errorf("h2/c1's broker served another container's connects: %+v then %+v", before, after)
		}
		if n := appCounters(t, l, "h2")["connect_fast"]; n != fast {
			t.Errorf("connect_fast moved by %d", n-fast)
		}
	})

	t.Run("served once", func(t *testing.T) {
		// python with the shim, under the filter: the shim's tag passes it
		before := seccompOf(t, l, client)
		cmd, err := l.SeccompCommand(context.Background(), client, "python3", "-c", pyEpollFirst, sip.String(), "7000")
		if err != nil {
			t.Fatal(err)
		}
		cmd.Env = append(cmd.Env, "LD_PRELOAD="+l.Shim())
		if out, err := cmd.CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != "ok" {
			t.Fatalf("preloaded client under the filter: %v %s", err, out)
		}
		if after := seccompOf(t, l, client); after.Replaced+after.Fallback+after.Passed != before.Replaced+before.Fallback+before.Passed {
			t.Errorf("the seccomp agent handled a preloaded process's connect: %+v then %+v", before, after)
		}
	})

	t.Run("epoll first", func(t *testing.T) {
		before := seccompOf(t, l, client)
		out := seccompRun(t, l, client, 20*time.Second, "python3", "-c", pyEpollFirst, sip.String(), "7000")
		if strings.TrimSpace(out) != "ok" {
			t.Fatalf("epoll-registered connect: %q", out)
		}
		if after := seccompOf(t, l, client); after.Fallback == before.Fallback || after.Replaced != before.Replaced {
			t.Errorf("an epoll-registered socket was swapped: %+v then %+v", before, after)
		}
	})

	t.Run("privileged", func(t *testing.T) {
		// a process that may hold CAP_NET_ADMIN in the host's user
		// namespace gets no host socket through the agent either
		priv, err := l.AddContainer(context.Background(), "h2")
		if err != nil {
			t.Fatal(err)
		}
		appWaitBroker(t, l, priv, 10*time.Second)
		before := seccompOf(t, l, priv)
		cmd, err := l.SeccompCommandCaps(context.Background(), RuntimeCaps+",+net_admin", priv, app, "loop", echo.String(), "3")
		if err != nil {
			t.Fatal(err)
		}
		if out, err := cmd.CombinedOutput(); err != nil || !strings.HasPrefix(string(out), "ok 3") {
			t.Fatalf("a privileged process's connections: %v %s", err, out)
		}
		if after := seccompOf(t, l, priv); after.Replaced != before.Replaced || after.Fallback < before.Fallback+3 {
			t.Errorf("a privileged process got host sockets: %+v then %+v", before, after)
		}
	})

	t.Run("caller died", func(t *testing.T) {
		pid := brokerPID(t, l, client)
		syscall.Kill(pid, syscall.SIGSTOP)
		cmd, err := l.SeccompCommand(context.Background(), client, app, "hold", echo.String())
		if err != nil {
			syscall.Kill(pid, syscall.SIGCONT)
			t.Fatal(err)
		}
		p := startProc(t, cmd, false)
		time.Sleep(300 * time.Millisecond) // its connect waits for the stopped broker
		cmd.Process.Kill()
		p.wait(5 * time.Second)
		syscall.Kill(pid, syscall.SIGCONT)
		loop(t, 20, 0, func() {})
		if brokerPID(t, l, client) != pid {
			t.Error("the broker was restarted")
		}
	})
}
