package lab

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/bench"
)

// The real applications below run unchanged in sockets mode: servers in
// h1/c1 (their listeners replaced by host sockets), clients in h2/c1, once
// with the shim and once with SKIFF_SOCKETS=off (plain overlay towards the
// same replaced server). Both runs must work and return the same content,
// and the agents' counters must show which path each run took.

var appOverlayNet = netip.MustParsePrefix("10.244.0.0/16")

// appBuf is a bytes.Buffer safe for a process's output goroutines and the
// test reading it at the same time.
type appBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *appBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *appBuf) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// appTool finds a tool on PATH or skips the test.
func appTool(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Skipf("%s not on PATH", name)
	}
	return p
}

// appEnv is cmd's environment with the shim switched off (off) and without
// proxy settings, which would send HTTP clients elsewhere.
func appEnv(cmd *exec.Cmd, off bool) {
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	env := cmd.Env[:0:0]
	for _, kv := range cmd.Env {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasSuffix(strings.ToLower(k), "_proxy") || k == "SKIFF_SOCKETS" {
			continue
		}
		env = append(env, kv)
	}
	if off {
		env = append(env, "SKIFF_SOCKETS=off")
	}
	cmd.Env = env
}

// appServer starts prog in target (with the shim, so its listener is
// replaced) and waits until its host lists the replaced listener on port
// and every client in clients has a fast-path route to it. The server is
// killed when the (sub)test ends.
func appServer(t *testing.T, l *Lab, target string, port uint16, clients []string, prog string, args ...string) *proc {
	t.Helper()
	cmd, err := l.Command(context.Background(), target, prog, args...)
	if err != nil {
		t.Fatal(err)
	}
	appEnv(cmd, false)
	p := startProc(t, cmd, false)
	ip, _ := l.IP(target)
	ap := netip.AddrPortFrom(ip, port)
	c, err := l.Container(target)
	if err != nil {
		t.Fatal(err)
	}
	waitListener(t, l, c.Host, ap, p.exited)
	for _, c := range clients {
		appWaitRoute(t, l, c, ap, 10*time.Second)
	}
	return p
}

// appRouteReady reports whether client's host has a fast-path route to
// dst. The routes live in the host's pinned sks_routes map (key struct
// sks_key: address and port in network order, pad); an agent writes them
// when it learns of a listener another agent published, so a client
// started before that would take the overlay.
func appRouteReady(l *Lab, client string, dst netip.AddrPort) (bool, error) {
	c, err := l.Container(client)
	if err != nil {
		return false, err
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(l.bpfDir(c.Host), "sockets", "sks_routes"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return false, err
	}
	defer m.Close()
	var key [8]byte
	dst4 := dst.Addr().As4()
	copy(key[0:4], dst4[:])
	binary.BigEndian.PutUint16(key[4:6], dst.Port())
	var host uint32
	err = m.Lookup(key, &host)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, nil
	}
	return err == nil, err
}

func appWaitRoute(t *testing.T, l *Lab, client string, dst netip.AddrPort, timeout time.Duration) {
	t.Helper()
	_, err := eventually(timeout, func() error {
		ok, err := appRouteReady(l, client, dst)
		if err != nil {
			return err
		}
		if !ok {
			return errors.New("no route")
		}
		return nil
	})
	if err != nil {
		t.Fatalf("fast-path route %s -> %s not installed after %v: %v", client, dst, timeout, err)
	}
}

// appRun runs prog in target and returns its stdout; a failure (exit code,
// timeout) ends the test with stdout and stderr. off switches the shim off.
func appRun(t *testing.T, l *Lab, target string, off bool, timeout time.Duration, prog string, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd, err := l.Command(ctx, target, prog, args...)
	if err != nil {
		t.Fatal(err)
	}
	appEnv(cmd, off)
	var stdout, stderr appBuf
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 2 * time.Second
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s in %s (%s): %v (context: %v)\nstdout:\n%s\nstderr:\n%s", filepath.Base(prog), strings.Join(args, " "),
			target, appModeName(off), err, ctx.Err(), tail([]byte(stdout.String()), 3000), tail([]byte(stderr.String()), 3000))
	}
	return []byte(stdout.String())
}

func appModeName(off bool) string {
	if off {
		return "SKIFF_SOCKETS=off"
	}
	return "sockets"
}

// appCounters returns a host's sockets-layer counters.
func appCounters(t *testing.T, l *Lab, host string) map[string]uint64 {
	t.Helper()
	return socketsStatus(t, l, host).Counters
}

func appDeltas(before, after map[string]uint64) map[string]uint64 {
	d := map[string]uint64{}
	for k, v := range after {
		if v != before[k] {
			d[k] = v - before[k]
		}
	}
	return d
}

func appFormat(d map[string]uint64) string {
	keys := make([]string, 0, len(d))
	for k := range d {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " %s+%d", k, d[k])
	}
	if b.Len() == 0 {
		return " (none)"
	}
	return b.String()
}

// appBoth runs client first with the shim and then with SKIFF_SOCKETS=off,
// from clientTarget to a replaced server in serverTarget. It checks after
// each run that the counters show the path it should have taken: the fast
// path (connect_fast on the client's host, assigned on the server's) with
// the shim, the overlay to the replaced listener (overlay_assigned, and no
// fast-path counter moves) without. Both runs must return the same content.
func appBoth(t *testing.T, l *Lab, serverTarget, clientTarget string, client func(t *testing.T, off bool) string) {
	t.Helper()
	sc, _ := l.Container(serverTarget)
	cc, _ := l.Container(clientTarget)
	hosts := []string{sc.Host}
	if cc.Host != sc.Host {
		hosts = append(hosts, cc.Host)
	}
	var results [2]string
	for i, off := range []bool{false, true} {
		before := map[string]map[string]uint64{}
		for _, h := range hosts {
			before[h] = appCounters(t, l, h)
		}
		results[i] = client(t, off)
		d := map[string]map[string]uint64{}
		for _, h := range hosts {
			d[h] = appDeltas(before[h], appCounters(t, l, h))
			t.Logf("%s %s -> %s: %s counters%s", appModeName(off), clientTarget, serverTarget, h, appFormat(d[h]))
		}
		if !off {
			if d[cc.Host]["connect_fast"] == 0 {
				t.Errorf("sockets run: connect_fast on %s did not move: the client did not take the fast path", cc.Host)
			}
			if d[sc.Host]["assigned"] == 0 {
				t.Errorf("sockets run: assigned on %s did not move: no option SYN reached the replaced listener", sc.Host)
			}
		} else {
			if d[sc.Host]["overlay_assigned"] == 0 {
				t.Errorf("SKIFF_SOCKETS=off run: overlay_assigned on %s did not move: the overlay did not reach the replaced listener", sc.Host)
			}
			if n := d[cc.Host]["connect_fast"]; n != 0 {
				t.Errorf("SKIFF_SOCKETS=off run: connect_fast on %s moved by %d", cc.Host, n)
			}
			if n := d[sc.Host]["assigned"]; n != 0 {
				t.Errorf("SKIFF_SOCKETS=off run: assigned on %s moved by %d", sc.Host, n)
			}
		}
	}
	if results[0] != results[1] {
		t.Errorf("content differs:\n sockets:           %q\n SKIFF_SOCKETS=off: %q", results[0], results[1])
	}
}

// appRandomFile writes size random bytes to path and returns their sha256.
func appRandomFile(t *testing.T, path string, size int) string {
	t.Helper()
	data := make([]byte, size)
	rand.Read(data)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return appSHA(data)
}

func appSHA(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// appTempDir is a temporary directory every user can read (a server may
// drop privileges), removed when the test ends.
func appTempDir(t *testing.T, pattern string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", pattern)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// appMemcachedClient speaks the memcached text protocol: sets several keys
// (one value of 100 KiB), reads each back, a multi-get and a miss. It prints
// a digest of everything read back.
const appMemcachedClient = `
import hashlib, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
f = s.makefile("rwb")
def fail(msg):
    sys.exit("memcached client: " + msg)
vals = {"skapp:%d" % i: (("value-%d;" % i) * (i * 3 + 1)).encode() for i in range(6)}
vals["skapp:big"] = bytes((i * 7 + i // 251) % 256 for i in range(100 * 1024))
for k, v in vals.items():
    f.write(b"set %s 0 0 %d\r\n" % (k.encode(), len(v)) + v + b"\r\n")
    f.flush()
    r = f.readline()
    if r != b"STORED\r\n":
        fail("set %s: %r" % (k, r))
def read_values():
    got = {}
    while True:
        line = f.readline()
        if line == b"END\r\n":
            return got
        p = line.split()
        if len(p) != 4 or p[0] != b"VALUE":
            fail("bad line %r" % line)
        data = f.read(int(p[3]) + 2)
        if data[-2:] != b"\r\n":
            fail("value of %r not terminated" % p[1])
        got[p[1].decode()] = data[:-2]
h = hashlib.sha256()
for k, v in vals.items():
    f.write(b"get %s\r\n" % k.encode())
    f.flush()
    got = read_values()
    if got != {k: v}:
        fail("get %s: %d keys, value ok=%s" % (k, len(got), got.get(k) == v))
    h.update(got[k])
f.write(b"get " + b" ".join(k.encode() for k in vals) + b"\r\n")
f.flush()
if read_values() != vals:
    fail("multi-get differs")
f.write(b"get skapp:missing\r\n")
f.flush()
if read_values() != {}:
    fail("miss returned a value")
f.write(b"quit\r\n")
f.flush()
print("ok keys=%d sha256=%s" % (len(vals), h.hexdigest()))
`

// appHTTPClient fetches a file with urllib (no proxy) and reports the names
// of a plain connection to the server.
const appHTTPClient = `
import hashlib, socket, sys, urllib.request
ip, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
body = opener.open("http://%s:%d/%s" % (ip, port, path), timeout=10).read()
s = socket.create_connection((ip, port), timeout=10)
print("local %s:%d" % s.getsockname())
print("peer %s:%d" % s.getpeername())
s.close()
print("body %d %s" % (len(body), hashlib.sha256(body).hexdigest()))
`

// appField returns the value after "key " on a line of out.
func appField(t *testing.T, out []byte, key string) string {
	t.Helper()
	for _, line := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %q line in output:\n%s", key, out)
	return ""
}

// TestSocketsApps runs real applications across hosts in sockets mode and
// compares each with the plain overlay.
func TestSocketsApps(t *testing.T) {
	l := newLab(t, Config{Name: "skapp", Hosts: 2, ContainersPerHost: 1, Mode: "sockets"})
	const server, client = "h1/c1", "h2/c1"
	sip, _ := l.IP(server)
	cip, _ := l.IP(client)
	clients := []string{client}
	appWaitBroker(t, l, server, 10*time.Second)
	appWaitBroker(t, l, client, 10*time.Second)

	t.Run("nginx", func(t *testing.T) {
		nginx := appTool(t, "nginx")
		curl := appTool(t, "curl")
		wget, _ := exec.LookPath("wget")
		dir := appTempDir(t, "skapp-nginx-")
		if err := bench.WriteNginxFiles(dir, netip.AddrPortFrom(sip, 8080).String()); err != nil {
			t.Fatal(err)
		}
		want := appRandomFile(t, filepath.Join(dir, "www", "blob.bin"), 100*1024)
		appServer(t, l, server, 8080, clients, nginx, "-p", dir, "-c", filepath.Join(dir, "nginx.conf"), "-e", "stderr")
		url := fmt.Sprintf("http://%s:8080/blob.bin", sip)
		appBoth(t, l, server, client, func(t *testing.T, off bool) string {
			got := appSHA(appRun(t, l, client, off, 20*time.Second, curl, "-sS", "--fail", "--noproxy", "*", "--max-time", "10", "-o", "-", url))
			if got != want {
				t.Errorf("curl (%s): sha256 %s, want %s", appModeName(off), got, want)
			}
			if wget != "" {
				got := appSHA(appRun(t, l, client, off, 20*time.Second, wget, "-q", "--no-proxy", "--timeout=10", "--tries=1", "-O", "-", url))
				if got != want {
					t.Errorf("wget (%s): sha256 %s, want %s", appModeName(off), got, want)
				}
			}
			return got
		})
	})

	t.Run("memcached", func(t *testing.T) {
		memcached := appTool(t, "memcached")
		python := appTool(t, "python3")
		appServer(t, l, server, 11211, clients, memcached, "-u", "root", "-l", sip.String(), "-p", "11211", "-U", "0", "-t", "2")
		appBoth(t, l, server, client, func(t *testing.T, off bool) string {
			out := appRun(t, l, client, off, 20*time.Second, python, "-c", appMemcachedClient, sip.String(), "11211")
			res := strings.TrimSpace(string(out))
			if !strings.HasPrefix(res, "ok keys=7 ") {
				t.Errorf("memcached client (%s): %q", appModeName(off), res)
			}
			return res
		})
	})

	t.Run("iperf3", func(t *testing.T) {
		iperf3 := appTool(t, "iperf3")
		appBoth(t, l, server, client, func(t *testing.T, off bool) string {
			// -1: the server ends after one test; a new one for each run.
			srv := appServer(t, l, server, 5201, clients, iperf3, "-s", "-1", "-B", sip.String(), "-p", "5201")
			out := appRun(t, l, client, off, 30*time.Second, iperf3, "-c", sip.String(), "-p", "5201", "-t", "2", "-J")
			var res struct {
				Error string `json:"error"`
				End   struct {
					SumReceived struct {
						Bytes         uint64  `json:"bytes"`
						BitsPerSecond float64 `json:"bits_per_second"`
					} `json:"sum_received"`
				} `json:"end"`
			}
			var raw map[string]any
			if err := json.Unmarshal(out, &res); err != nil {
				t.Fatalf("iperf3 JSON (%s): %v\n%s", appModeName(off), err, tail(out, 2000))
			}
			json.Unmarshal(out, &raw)
			if _, ok := raw["error"]; ok || res.End.SumReceived.Bytes == 0 {
				t.Errorf("iperf3 (%s): error %q, %d bytes received", appModeName(off), res.Error, res.End.SumReceived.Bytes)
			}
			t.Logf("iperf3 (%s): %d bytes, %.2f Gbit/s", appModeName(off), res.End.SumReceived.Bytes, res.End.SumReceived.BitsPerSecond/1e9)
			if err := srv.wait(10 * time.Second); err != nil {
				t.Errorf("iperf3 server (%s): %v\n%s", appModeName(off), err, srv.out.String())
			}
			return "ok"
		})
	})

	t.Run("sockperf", func(t *testing.T) {
		sockperf := appTool(t, "sockperf")
		appServer(t, l, server, 11111, clients, sockperf, "server", "--tcp", "-i", sip.String(), "-p", "11111")
		latency := regexp.MustCompile(`avg-lat(ency)?\s*=\s*[0-9.]+`)
		appBoth(t, l, server, client, func(t *testing.T, off bool) string {
			out := appRun(t, l, client, off, 30*time.Second, sockperf, "ping-pong", "--tcp", "-i", sip.String(), "-p", "11111", "-t", "2")
			m := latency.Find(out)
			if m == nil {
				t.Errorf("sockperf (%s): no latency line:\n%s", appModeName(off), tail(out, 2000))
			}
			t.Logf("sockperf (%s): %s", appModeName(off), m)
			return "ok"
		})
	})

	t.Run("python-http", func(t *testing.T) {
		python := appTool(t, "python3")
		dir := appTempDir(t, "skapp-http-")
		want := appRandomFile(t, filepath.Join(dir, "blob.bin"), 100*1024)
		appServer(t, l, server, 8000, clients, python, "-m", "http.server", "--bind", sip.String(), "8000", "--directory", dir)
		appBoth(t, l, server, client, func(t *testing.T, off bool) string {
			out := appRun(t, l, client, off, 20*time.Second, python, "-c", appHTTPClient, sip.String(), "8000", "blob.bin")
			body := appField(t, out, "body")
			if body != fmt.Sprintf("%d %s", 100*1024, want) {
				t.Errorf("urllib (%s): body %s, want %d %s", appModeName(off), body, 100*1024, want)
			}
			local, err := netip.ParseAddrPort(appField(t, out, "local"))
			if err != nil {
				t.Fatal(err)
			}
			peer, err := netip.ParseAddrPort(appField(t, out, "peer"))
			if err != nil {
				t.Fatal(err)
			}
			if !appOverlayNet.Contains(local.Addr()) || !appOverlayNet.Contains(peer.Addr()) {
				t.Errorf("(%s) names leak outside the overlay: getsockname %s, getpeername %s", appModeName(off), local, peer)
			}
			if local.Addr() != cip || peer != netip.AddrPortFrom(sip, 8000) {
				t.Errorf("(%s) getsockname %s, getpeername %s; want %s:*, %s:8000", appModeName(off), local, peer, cip, sip)
			}
			return body
		})
	})

	t.Run("sockcheck", func(t *testing.T) {
		sockcheck := filepath.Join(l.Config.BinDir, "sockcheck")
		if _, err := os.Stat(sockcheck); err != nil {
			t.Fatalf("sockcheck not built (make build): %v", err)
		}
		local, err := l.AddContainer(context.Background(), "h1")
		if err != nil {
			t.Fatal(err)
		}
		lip, _ := l.IP(local)
		appWaitBroker(t, l, local, 10*time.Second)
		const net = "10.244.0.0/16"
		srv := appServer(t, l, server, 9000, []string{client, local}, sockcheck, "server", sip.String(), "9000", "--expect-net", net)
		for _, c := range []struct {
			name string
			ip   netip.Addr
		}{{client, cip}, {local, lip}} {
			t.Run(strings.ReplaceAll(c.name, "/", "-"), func(t *testing.T) {
				appBoth(t, l, server, c.name, func(t *testing.T, off bool) string {
					host := "yes"
					if off {
						host = "no"
					}
					out := appRun(t, l, c.name, off, 30*time.Second, sockcheck, "client", sip.String(), "9000",
						"--expect-net", net, "--server-peer", c.ip.String(), "--host", host)
					var oks []string
					for _, line := range strings.Split(string(out), "\n") {
						if strings.HasPrefix(line, "FAIL") {
							t.Errorf("sockcheck client in %s (%s): %s", c.name, appModeName(off), line)
						}
						if name, ok := strings.CutPrefix(line, "ok   "); ok {
							oks = append(oks, name)
						}
					}
					if len(oks) == 0 {
						t.Errorf("sockcheck client in %s (%s) reported no check:\n%s", c.name, appModeName(off), out)
					}
					return strings.Join(oks, ",")
				})
			})
		}
		out := srv.out.String()
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "FAIL") {
				t.Errorf("sockcheck server: %s", line)
			}
		}
		if !strings.Contains(out, "ok   accept4-flags") {
			t.Errorf("sockcheck server did not check accept4 flags:\n%s", out)
		}
	})
}

// appWaitBroker waits until target's broker runs, so the shim gets host
// sockets from the first call on.
func appWaitBroker(t *testing.T, l *Lab, target string, timeout time.Duration) {
	t.Helper()
	c, err := l.Container(target)
	if err != nil {
		t.Fatal(err)
	}
	_, err = eventually(timeout, func() error {
		for _, sc := range socketsStatus(t, l, c.Host).Containers {
			if sc.IP == c.IP.String() && sc.Broker {
				return nil
			}
		}
		return fmt.Errorf("no running broker for %s (%s) on %s", target, c.IP, c.Host)
	})
	if err != nil {
		t.Fatal(err)
	}
}
