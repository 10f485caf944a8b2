package lab

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/layer/layertest"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/policy"
)

func cacheStats(t *testing.T, l *Lab, host string) map[string]uint64 {
	t.Helper()
	st, err := agentOf(t, l, host).Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !runs(st, "cache") {
		t.Fatalf("%s runs no cache layer (mode %s)", host, st.Mode)
	}
	return countersIn(st, "cache")
}

// fastShare is the share of packets from_container handled on the fast
// path between two counter snapshots (counters kept besides a packet's
// outcome are not outcomes).
func fastShare(before, after map[string]uint64) (hits, others uint64) {
	besides := []string{"table_hit", "table_open", "forged_marks_cleared", "syn_flow_forgotten", "pass_not_ipv4"}
	for k, v := range after {
		d := v - before[k]
		outcome, ok := strings.CutPrefix(k, "from_container/")
		switch {
		case outcome == "hit":
			hits += d
		case ok && !slices.Contains(besides, outcome):
			others += d
		}
	}
	return hits, others
}

// TestCacheCarriesTraffic: TCP, UDP and ICMP across hosts in cache mode
// work, and the counters show the fast path carried the bulk of them.
func TestCacheCarriesTraffic(t *testing.T) {
	l := newLab(t, Config{Name: "tcache", Hosts: 2, ContainersPerHost: 2, Mode: "cache"})
	ctx := context.Background()
	echoServer(t, l, "h2/c1", echoPort)
	dst, _ := l.IP("h2/c1")
	to := netip.AddrPortFrom(dst, echoPort)
	before := cacheStats(t, l, "h1")
	// One TCP connection and one UDP socket carrying many messages each.
	for _, network := range []string{"tcp4", "udp4"} {
		c, err := dial(l, "h1/c1", network, to, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 100)
		for i := range 300 {
			c.SetDeadline(time.Now().Add(2 * time.Second))
			msg := []byte(fmt.Sprintf("%s message %d", network, i))
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			n, err := c.Read(buf)
			if err != nil || string(buf[:n]) != string(msg) {
				t.Fatalf("%s echo %d: %q %v", network, i, buf[:n], err)
			}
		}
		c.Close()
	}
	cmd, _ := l.Command(ctx, "h1/c1", "ping", "-c", "20", "-i", "0.01", "-W", "2", dst.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("ping: %v\n%s", err, out)
	}
	after := cacheStats(t, l, "h1")
	hits, others := fastShare(before, after)
	t.Logf("h1 from_container: %d fast-path packets, %d to the overlay", hits, others)
	for k, v := range after {
		if v != before[k] {
			t.Logf("  %s +%d", k, v-before[k])
		}
	}
	if hits < 9*others || hits < 500 {
		t.Errorf("fast path carried %d packets, overlay %d: the bulk should be on the fast path", hits, others)
	}
	if d := after["from_underlay/hit"] - before["from_underlay/hit"]; d < 500 {
		t.Errorf("only %d replies took the ingress fast path", d)
	}
	// Same-host traffic stays on the bridge.
	local, _ := l.IP("h1/c2")
	if err := ping(ctx, l, "h1/c1", local); err != nil {
		t.Error(err)
	}
}

// TestCacheDenyStopsCachedFlow: a deny rule added while a flow is on the
// fast path stops it. How fast is logged: on the busy CI machine a fixed
// bound flakes, and timing belongs in benchmarks.
func TestCacheDenyStopsCachedFlow(t *testing.T) {
	l := newLab(t, Config{Name: "tcdeny", Hosts: 2, ContainersPerHost: 1, Mode: "cache"})
	s := startStream(t, l, "h1/c1", "h2/c1", 7300)
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	before := cacheStats(t, l, "h1")["from_container/hit"]
	time.Sleep(500 * time.Millisecond)
	if after := cacheStats(t, l, "h1")["from_container/hit"]; after == before {
		t.Fatal("the flow is not on the fast path")
	}
	denyStops(t, l, s, "h2/c1", 7300)
}

// denyStops denies the stream s to target's port and checks it stops.
func denyStops(t *testing.T, l *Lab, s *stream, target string, port uint16) {
	t.Helper()
	dst, _ := l.IP(target)
	rule := policy.Rule{ID: "cut", Priority: 1, Action: policy.Deny, Dst: netip.PrefixFrom(dst, 32), Proto: policy.TCP, Port: port}
	if err := l.PutPolicy(context.Background(), rule); err != nil {
		t.Fatal(err)
	}
	took, err := s.stops(converges, 300*time.Millisecond)
	if err != nil {
		t.Fatalf("the cached flow still moves %v after the deny rule", took.Round(time.Millisecond))
	}
	t.Logf("the flow stopped within %v of the deny rule (300 ms without progress included)", took.Round(time.Millisecond))
	s.finish()
}

// TestCacheAgentRestart: a transfer survives agent restarts and stays on
// the fast path (pinned maps and attached programs outlive the agent).
func TestCacheAgentRestart(t *testing.T) {
	l := newLab(t, Config{Name: "tcrest", Hosts: 2, ContainersPerHost: 1, Mode: "cache"})
	ctx := context.Background()
	s := startStream(t, l, "h1/c1", "h2/c1", 7400)
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if err := l.StopAgent(ctx, "h1"); err != nil {
		t.Fatal(err)
	}
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatalf("stalled with the agent down: %v", err)
	}
	if err := l.StartAgent(ctx, "h1"); err != nil {
		t.Fatal(err)
	}
	before := cacheStats(t, l, "h1")
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatalf("stalled after the restart: %v", err)
	}
	time.Sleep(300 * time.Millisecond)
	hits, others := fastShare(before, cacheStats(t, l, "h1"))
	if hits == 0 || others > hits/10 {
		t.Errorf("after the restart: %d fast-path packets, %d via the overlay", hits, others)
	}
	if err := s.finish(); err != nil {
		t.Fatal(err)
	}
}

// TestAddressMovesHost: a container's address comes back on another host
// (its old host left, the subnet went to a new host): traffic reaches the
// new place, and no cache entry still points at the old one; with every
// layer (auto), a replaced listener at the address is reached on its new
// host too.
func TestAddressMovesHost(t *testing.T) {
	for _, mode := range []string{"cache", "auto"} {
		t.Run(mode, func(t *testing.T) { addressMovesHost(t, mode, "t"+mode[:2]+"move", nil) })
	}
	// The rewriting tunnel: no key of the old pair survives on h1.
	t.Run("cache-rewrite", func(t *testing.T) { addressMovesHost(t, "cache", "trwmove", rewriteArgs) })
}

func addressMovesHost(t *testing.T, mode, labName string, args []string) {
	l := newLab(t, Config{Name: labName, Hosts: 2, ContainersPerHost: 1, Mode: mode, AgentArgs: args})
	ctx := context.Background()
	old, _ := l.IP("h2/c1")
	oldHost, _ := l.IP("h2")
	cmd, _ := l.Command(ctx, "h1/c1", "ping", "-c", "10", "-i", "0.01", old.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	sockets := mode == "auto"
	if sockets {
		p := startPy(t, l, "h2/c1", pyEcho, nil, old.String(), "7000")
		waitListener(t, l, "h2", netip.AddrPortFrom(old, 7000), p.exited)
		appWaitRoute(t, l, "h1/c1", netip.AddrPortFrom(old, 7000), 10*time.Second)
		if out := runPy(t, l, "h1/c1", pyOnce, nil, old.String(), "7000"); !strings.HasPrefix(out, "ok") {
			t.Fatalf("replaced listener before the move: %s", out)
		}
	}
	if err := l.RemoveHost(ctx, "h2"); err != nil {
		t.Fatal(err)
	}
	name, err := l.AddHost(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c, err := l.AddContainer(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	moved, _ := l.IP(c)
	if moved != old {
		t.Fatalf("new container got %s, the test needs the old address %s", moved, old)
	}
	newHost, _ := l.IP(name)
	cmd, _ = l.Command(ctx, "h1/c1", "ping", "-c", "10", "-i", "0.01", "-W", "2", old.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("ping the moved address: %v\n%s", err, out)
	}
	entries := cacheEntries(t, l, "h1")
	for _, e := range entries.EgressIPs {
		if e.Container == old && e.Host != newHost {
			t.Errorf("%s still cached at %s", old, e.Host)
		}
	}
	for _, e := range entries.EgressHosts {
		if e.Host == oldHost {
			t.Errorf("headers for departed host %s still cached", oldHost)
		}
	}
	for _, k := range entries.TunnelKeys {
		if k.Peer == oldHost && !k.Dead {
			t.Errorf("a live tunnel key %d of departed host %s", k.Key, oldHost)
		}
	}
	if sockets {
		p := startPy(t, l, c, pyEcho, nil, old.String(), "7000")
		waitListener(t, l, name, netip.AddrPortFrom(old, 7000), p.exited)
		appWaitRoute(t, l, "h1/c1", netip.AddrPortFrom(old, 7000), 10*time.Second)
		before := counter(t, l, name, "accepted")
		if out := runPy(t, l, "h1/c1", pyOnce, nil, old.String(), "7000"); !strings.HasPrefix(out, "ok") {
			t.Fatalf("replaced listener after the move: %s", out)
		}
		if counter(t, l, name, "accepted") == before {
			t.Errorf("the connection to %s did not reach the replaced listener on %s", old, name)
		}
	}
}

// TestCacheAtCapacity: with caches far smaller than the number of flows,
// every flow still works (LRU eviction, misses fall back to the overlay).
func TestCacheAtCapacity(t *testing.T) {
	l := newLab(t, Config{Name: "tccap", Hosts: 2, ContainersPerHost: 2, Mode: "cache",
		AgentArgs: []string{"--cache-capacity", "2,2,2,2"}})
	for _, c := range []string{"h2/c1", "h2/c2"} {
		echoServer(t, l, c, echoPort)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for _, src := range []string{"h1/c1", "h1/c2"} {
		for _, dst := range []string{"h2/c1", "h2/c2"} {
			for port := range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					ip, _ := l.IP(dst)
					var c net.Conn
					err := l.Do(src, func() (err error) {
						c, err = net.DialTimeout("tcp4", netip.AddrPortFrom(ip, echoPort).String(), 2*time.Second)
						return err
					})
					if err != nil {
						errs <- err
						return
					}
					defer c.Close()
					buf := make([]byte, 64)
					for i := range 200 {
						c.SetDeadline(time.Now().Add(3 * time.Second))
						msg := fmt.Sprintf("%s->%s #%d/%d", src, dst, port, i)
						if _, err := c.Write([]byte(msg)); err != nil {
							errs <- err
							return
						}
						n, err := c.Read(buf)
						if err != nil || string(buf[:n]) != msg {
							errs <- fmt.Errorf("%s: got %q, %v", msg, buf[:n], err)
							return
						}
					}
				}()
			}
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	st := cacheStats(t, l, "h1")
	t.Logf("at capacity: %d hits, %d filter misses", st["from_container/hit"], st["from_container/miss_filter"])
	// The load drops to one flow: it comes back onto the fast path.
	ip, _ := l.IP("h2/c1")
	c, err := dial(l, "h1/c1", "tcp4", netip.AddrPortFrom(ip, echoPort), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 64)
	before := cacheStats(t, l, "h1")
	for i := range 200 {
		c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write([]byte(fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Read(buf); err != nil {
			t.Fatal(err)
		}
	}
	hits, others := fastShare(before, cacheStats(t, l, "h1"))
	t.Logf("one flow after the load: %d fast-path packets, %d via the overlay", hits, others)
	if hits < 150 {
		t.Errorf("the fast path did not recover: %d hits, %d via the overlay", hits, others)
	}
}

// TestCacheModeSwitchBack: restarting the agents in overlay mode removes
// the fast path (no skiff program left on any host link, maps unpinned) and
// traffic goes on over the overlay.
func TestCacheModeSwitchBack(t *testing.T) {
	l := newLab(t, Config{Name: "tcback", Hosts: 2, ContainersPerHost: 1, Mode: "cache"})
	ctx := context.Background()
	dst, _ := l.IP("h2/c1")
	if err := ping(ctx, l, "h1/c1", dst); err != nil {
		t.Fatal(err)
	}
	restartAgents(t, l, "overlay")
	for _, h := range []string{"h1", "h2"} {
		noCacheLayer(t, l, h)
	}
	st, err := api.NewClient(l.Hosts[0].Socket).Status(ctx)
	if err != nil || st.Mode != "overlay" || runs(st, "cache") {
		t.Fatalf("status after switching back: %+v %v", st, err)
	}
	if err := ping(ctx, l, "h1/c1", dst); err != nil {
		t.Fatal(err)
	}
}

// TestCacheMarksStayInside: packets from a container to a host outside the
// overlay carry no mark, even when the container's flows to that host's
// containers are cached; and the metrics endpoint serves the counters.
func TestCacheMarksStayInside(t *testing.T) {
	l := newLab(t, Config{Name: "tcmarks", Hosts: 2, ContainersPerHost: 1, Mode: "cache",
		AgentArgs: []string{"--metrics-addr", "127.0.0.1:9473"}})
	ctx := context.Background()
	// Warm the fast path between the containers first.
	dst, _ := l.IP("h2/c1")
	cmd, _ := l.Command(ctx, "h1/c1", "ping", "-c", "5", "-i", "0.01", dst.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	// A UDP receiver on host h2's underlay address reports each datagram's TOS.
	var conn *net.UDPConn
	err := l.Do("h2", func() (err error) {
		conn, err = net.ListenUDP("udp4", &net.UDPAddr{Port: 7500})
		if err != nil {
			return err
		}
		raw, _ := conn.SyscallConn()
		var serr error
		raw.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_RECVTOS, 1) })
		return serr
	})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	h2, _ := l.IP("h2")
	for _, src := range []string{"h1/c1", "h2/c1"} { // across the underlay, and to its own host
		c, err := dial(l, src, "udp4", netip.AddrPortFrom(h2, 7500), time.Second)
		if err != nil {
			t.Fatal(err)
		}
		for range 20 {
			c.Write([]byte("tos?"))
			conn.SetReadDeadline(time.Now().Add(2 * time.Second))
			buf, oob := make([]byte, 16), make([]byte, 64)
			_, oobn, _, _, err := conn.ReadMsgUDP(buf, oob)
			if err != nil {
				t.Fatal(err)
			}
			msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				if m.Header.Type == unix.IP_TOS && len(m.Data) > 0 && m.Data[0]&0x0c != 0 {
					t.Fatalf("a packet from %s left the overlay with TOS %#x", src, m.Data[0])
				}
			}
		}
		c.Close()
	}
	body := scrape(t, l, "h1", "127.0.0.1:9473")
	// The body after the HTTP header: the text format, whatever order
	// the labels come in.
	text := body[strings.Index(body, "\r\n\r\n")+4:]
	if layertest.Value(t, text, "skiff_cache_packets_total", map[string]string{"program": "from_container", "outcome": "hit"}) == 0 ||
		layertest.Value(t, text, "skiff_ready", nil) != 1 || layertest.Value(t, text, "skiff_endpoints", nil) != 1 {
		t.Errorf("metrics lack cache hits, ready or the endpoint:\n%s", body)
	}
}

// scrape returns what the agent of host serves on addr's /metrics.
func scrape(t *testing.T, l *Lab, host, addr string) string {
	t.Helper()
	var body []byte
	err := l.Do(host, func() error {
		c, err := net.Dial("tcp4", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		fmt.Fprintf(c, "GET /metrics HTTP/1.0\r\n\r\n")
		c.SetReadDeadline(time.Now().Add(2 * time.Second))
		body, err = io.ReadAll(c)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return string(body)
}

// TestCacheNotPoisoned: a VXLAN frame with both of skiff's marks in its
// inner header, sent to some address's VXLAN port by a container or by a
// host process, teaches the fast path nothing: the host keeps sending the
// victim's flows to the victim's host (issue 25, cache poisoning).
func TestCacheNotPoisoned(t *testing.T) {
	l := newLab(t, Config{Name: "tcpoison", Hosts: 2, ContainersPerHost: 1, Mode: "cache"})
	ctx := context.Background()
	h2, _ := l.Host("h2")
	attacker := netip.AddrPortFrom(switchAddr, 4789) // an address the attacker holds
	victim, _ := l.IP("h2/c1")
	src, _ := l.IP("h1/c1")
	frame := forgedVXLAN(overlay.VTEPMAC(h2.UnderlayIP), src, victim, 0x0c, 7000, []byte("poison"))
	egressOf := func() netip.Addr {
		t.Helper()
		for _, e := range cacheEntries(t, l, "h1").EgressIPs {
			if e.Container == victim {
				return e.Host
			}
		}
		return netip.Addr{}
	}
	forge := func(from string) {
		t.Helper()
		err := l.Do(from, func() error {
			c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(attacker))
			if err != nil {
				return err
			}
			defer c.Close()
			for range 20 {
				c.Write(frame)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, from := range []string{"h1/c1", "h1"} {
		forge(from)
		// The store names the victim's host before any traffic.
		if got := egressOf(); got != h2.UnderlayIP {
			t.Errorf("after a forged frame from %s: the victim's flows go to %v, want %s", from, got, h2.UnderlayIP)
		}
	}
	// Real traffic teaches the right host; forged frames do not move it.
	cmd, _ := l.Command(ctx, "h1/c1", "ping", "-c", "5", "-i", "0.01", victim.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if got := egressOf(); got != h2.UnderlayIP {
		t.Fatalf("after real traffic the victim's host is %v, want %s", got, h2.UnderlayIP)
	}
	for _, from := range []string{"h1/c1", "h1"} {
		forge(from)
		if got := egressOf(); got != h2.UnderlayIP {
			t.Errorf("after a forged frame from %s: the victim's flows go to %s", from, got)
		}
	}
}
