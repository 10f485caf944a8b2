package lab

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/steering"
)

// pyRoundTrips connects to argv[2]:argv[1] and the destinations after it in
// turn, sends and checks 10 echoes of 100 bytes on each connection, and
// prints "ok DST" per destination.
const pyRoundTrips = `
import socket, sys
for dst in sys.argv[2:]:
    s = socket.create_connection((dst, int(sys.argv[1])), timeout=5)
    for _ in range(10):
        s.sendall(b"x" * 100)
        got = b""
        while len(got) < 100:
            d = s.recv(100 - len(got))
            if not d:
                raise OSError(0, "closed")
            got += d
    s.close()
    print("ok", dst, flush=True)
`

// roundTrips sends n echoes over one connection from src (in-process: no
// shim) to addr.
func roundTrips(l *Lab, src, network string, addr netip.AddrPort, n int) error {
	c, err := dial(l, src, network, addr, 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	msg, got := make([]byte, 100), make([]byte, 100)
	for i := 0; i < n; i++ {
		if _, err := c.Write(msg); err != nil {
			return err
		}
		if _, err := io.ReadFull(c, got); err != nil {
			return fmt.Errorf("echo %d: %w", i, err)
		}
	}
	return nil
}

// layerCounters is what tells the paths apart: host sockets' fast connects,
// the cache's hits and the sockets joined to channels, summed over the
// lab's hosts.
type layerCounters struct{ fastConnects, cacheHits, channelJoins uint64 }

func countersOf(t *testing.T, l *Lab) layerCounters {
	t.Helper()
	var c layerCounters
	for _, h := range l.Hosts {
		st, err := agentOf(t, l, h.Name).Status(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if !runs(st, "sockets") || !runs(st, "cache") || !runs(st, "channels") {
			t.Fatalf("%s runs without the sockets, the cache or the channels layer: %+v", h.Name, st.Layers)
		}
		c.fastConnects += countersIn(st, "sockets")["connect_fast"]
		c.channelJoins += countersIn(st, "channels")["added"]
		cache := countersIn(st, "cache")
		c.cacheHits += cache["from_container/hit"] + cache["from_underlay/hit"]
	}
	return c
}

// TestAutoPaths: with every layer on (auto), each kind of traffic takes its
// layer, between every pair of 3 hosts x 2 containers: TCP between
// preloaded processes host sockets (the cache sees none of it), and only
// a same-host connection's sockets join the channels; TCP without
// the shim, UDP and ICMP the cache across hosts (host sockets none) and the
// overlay on one host (neither). Then a deny rule ends flows on both fast
// paths, transfers of each kind survive agent restarts, and restarting with
// one layer fewer leaves nothing of the other.
func TestAutoPaths(t *testing.T) {
	l := newLab(t, Config{Name: "tauto", Hosts: 3, ContainersPerHost: 2, Mode: "auto"})
	ctx := context.Background()
	st, err := agentOf(t, l, "h1").Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []api.Layer{{Name: "cache", On: true}, {Name: "channels", On: true}, {Name: "sockets", On: true}, {Name: "steering", Reason: steering.Manual}}
	var got []api.Layer
	for _, l := range st.Layers {
		got = append(got, api.Layer{Name: l.Name, On: l.On, Reason: l.Reason})
	}
	if st.Mode != "auto" || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("mode %q layers %+v, want auto with %+v", st.Mode, st.Layers, want)
	}
	// Every container serves a replaced echo server (the shim) on 7000 and
	// a plain one (in-process, no shim) on echoPort, TCP and UDP.
	for _, c := range l.Containers {
		p := startPy(t, l, c.Name, pyEcho, nil, c.IP.String(), "7000")
		waitListener(t, l, c.Host, netip.AddrPortFrom(c.IP, 7000), p.exited)
		echoServer(t, l, c.Name, echoPort)
	}
	for _, src := range l.Containers {
		var dsts []string
		for _, dst := range l.Containers {
			if dst.Name != src.Name {
				appWaitRoute(t, l, src.Name, netip.AddrPortFrom(dst.IP, 7000), 10*time.Second)
				dsts = append(dsts, dst.IP.String())
			}
		}
		before := countersOf(t, l)
		out := runPy(t, l, src.Name, pyRoundTrips, nil, append([]string{"7000"}, dsts...)...)
		after := countersOf(t, l)
		if n := strings.Count(out, "ok "); n != len(dsts) {
			t.Errorf("preloaded TCP from %s: %d of %d destinations: %s", src.Name, n, len(dsts), out)
		}
		// One destination is on src's host: its two sockets join; a
		// connection to another host pays no sk_msg path.
		if got := after.channelJoins - before.channelJoins; got != 2 {
			t.Errorf("preloaded TCP from %s: %d sockets joined channels, want 2 (the same-host connection's)", src.Name, got)
		}
		if got := after.fastConnects - before.fastConnects; got != uint64(len(dsts)) || after.cacheHits != before.cacheHits {
			t.Errorf("preloaded TCP from %s: %d fast connects (want %d), %d cache hits (want 0)",
				src.Name, got, len(dsts), after.cacheHits-before.cacheHits)
		}
	}
	for _, src := range l.Containers {
		for _, dst := range l.Containers {
			if src.Name == dst.Name {
				continue
			}
			cross := src.Host != dst.Host
			to := netip.AddrPortFrom(dst.IP, echoPort)
			for _, kind := range []string{"tcp4", "udp4", "icmp"} {
				before := countersOf(t, l)
				if kind == "icmp" {
					var cmd *exec.Cmd
					if cmd, err = l.Command(ctx, src.Name, "ping", "-c", "8", "-i", "0.01", "-W", "2", dst.IP.String()); err == nil {
						if out, perr := cmd.CombinedOutput(); perr != nil {
							err = fmt.Errorf("%w: %s", perr, out)
						}
					}
				} else {
					err = roundTrips(l, src.Name, kind, to, 20)
				}
				if err != nil {
					t.Errorf("%s %s -> %s: %v", kind, src.Name, dst.Name, err)
					continue
				}
				after := countersOf(t, l)
				hits := after.cacheHits - before.cacheHits
				if after.fastConnects != before.fastConnects || cross != (hits > 0) {
					t.Errorf("%s %s -> %s: %d fast connects (want 0), %d cache hits (want some: %v)",
						kind, src.Name, dst.Name, after.fastConnects-before.fastConnects, hits, cross)
				}
			}
		}
	}
	autoPolicy(t, l)
	autoRestart(t, l)
}

// autoPolicy: a deny rule ends an established flow on host sockets and one
// on the cache, and refuses new connections of both, and UDP.
func autoPolicy(t *testing.T, l *Lab) {
	t.Helper()
	ctx := context.Background()
	dst, _ := l.IP("h1/c1")
	hold := startPy(t, l, "h2/c1", pyHold, nil, dst.String(), "7000")
	hold.line(t, 10*time.Second)
	s := startStream(t, l, "h2/c1", "h1/c1", 7200)
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	deny := policy.Rule{ID: "cut", Priority: 1, Action: policy.Deny, Src: netip.MustParsePrefix("10.244.0.0/16"), Dst: netip.PrefixFrom(dst, 32)}
	if err := l.PutPolicy(ctx, deny); err != nil {
		t.Fatal(err)
	}
	if got := hold.line(t, converges); !strings.HasPrefix(got, "err") {
		t.Errorf("the host-socket connection after the deny rule: %q", got)
	}
	if _, err := s.stops(converges, 300*time.Millisecond); err != nil {
		t.Error("the cached flow still moves after the deny rule")
	}
	s.finish()
	if out := runPyErr(l, "h2/c1", pyOnce, dst.String(), "7000"); strings.HasPrefix(out, "ok") {
		t.Errorf("a new preloaded connection passed the deny rule: %s", out)
	}
	for _, kind := range []string{"tcp4", "udp4"} {
		if err := roundTrips(l, "h2/c1", kind, netip.AddrPortFrom(dst, echoPort), 1); err == nil {
			t.Errorf("%s passed the deny rule", kind)
		}
	}
	if err := l.DeletePolicy(ctx, "cut"); err != nil {
		t.Fatal(err)
	}
	if _, err := eventually(converges, func() error { return roundTrips(l, "h2/c1", "tcp4", netip.AddrPortFrom(dst, echoPort), 1) }); err != nil {
		t.Fatalf("after the rule went: %v", err)
	}
}

// runPyErr runs a Python program in target and returns its output, or the
// error with its output.
func runPyErr(l *Lab, target, prog string, args ...string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd, err := l.Command(ctx, target, "python3", append([]string{"-c", prog}, args...)...)
	if err != nil {
		return err.Error()
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Sprintf("%v: %s", err, out)
	}
	return string(out)
}

// autoRestart: transfers on host sockets and on the cache survive agent
// restarts; restarted with one layer, the other's programs, pins, rules
// and helpers are gone, and the transfers on the remaining path go on.
func autoRestart(t *testing.T, l *Lab) {
	t.Helper()
	dst, _ := l.IP("h1/c1")
	hold := startPy(t, l, "h2/c1", pyHold, nil, dst.String(), "7000")
	hold.line(t, 10*time.Second)
	s := startStream(t, l, "h2/c1", "h1/c1", 7300)
	defer s.finish()
	restartAgents(t, l, "auto")
	if err := s.progresses(2 * time.Second); err != nil {
		t.Errorf("cached transfer after the restart: %v", err)
	}
	select {
	case got := <-hold.lines:
		t.Errorf("the host-socket connection after the restart: %q %s", got, hold.out.String())
	case <-time.After(500 * time.Millisecond):
	}
	restartAgents(t, l, "cache")
	for _, h := range l.Hosts {
		noSocketsLayer(t, l, h.Name)
	}
	if err := s.progresses(2 * time.Second); err != nil {
		t.Errorf("cached transfer with the cache alone: %v", err)
	}
	restartAgents(t, l, "sockets")
	for _, h := range l.Hosts {
		noCacheLayer(t, l, h.Name)
	}
	if err := s.progresses(2 * time.Second); err != nil {
		t.Errorf("the transfer with the sockets layer alone (the overlay carries it): %v", err)
	}
}

// noCacheLayer checks that host has nothing of the cache layer: no program
// attached, no pinned map.
func noCacheLayer(t *testing.T, l *Lab, host string) {
	t.Helper()
	cmd, _ := l.Command(context.Background(), host, "sh", "-c", "for d in $(ls /sys/class/net); do tc filter show dev $d ingress; tc filter show dev $d egress; done; iptables -t mangle -S")
	out, err := cmd.CombinedOutput()
	if err != nil || strings.Contains(string(out), "skiff-cache") || strings.Contains(string(out), "SKIFF-CACHE") {
		t.Errorf("%s still has the cache layer (%v):\n%s", host, err, out)
	}
	for _, dir := range []string{filepath.Join(l.bpfDir(host), "cache"), l.bpfDir(host)} {
		if _, err := os.Stat(filepath.Join(dir, "skc_control")); err == nil {
			t.Errorf("%s still has pinned cache maps in %s", host, dir)
		}
	}
}
