package lab

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/tc/tctest"
)

// The cache's rewriting tunnel (--cache-tunnel rewrite, cache/tunnel.h).

var rewriteArgs = []string{"--cache-tunnel", cache.TunnelRewrite}

// counted is how much counter name moved between two snapshots.
func counted(before, after map[string]uint64, name string) uint64 { return after[name] - before[name] }

// TestRewriteCarriesTraffic: TCP, UDP and ICMP between hosts that both
// rewrite travel rewritten both ways once a pair's keys are exchanged, and
// arrive intact; the hosts announce the tunnel in their records.
func TestRewriteCarriesTraffic(t *testing.T) {
	l := newLab(t, Config{Name: "trw", Hosts: 2, ContainersPerHost: 2, Mode: "cache", AgentArgs: rewriteArgs})
	ctx := context.Background()
	st, err := agentOf(t, l, "h1").Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(st.Host.Features, cache.FeatureRewrite) {
		t.Fatalf("h1's record announces %v, want %s", st.Host.Features, cache.FeatureRewrite)
	}
	echoServer(t, l, "h2/c1", echoPort)
	dst, _ := l.IP("h2/c1")
	to := netip.AddrPortFrom(dst, echoPort)
	before1, before2 := cacheStats(t, l, "h1"), cacheStats(t, l, "h2")
	for _, network := range []string{"tcp4", "udp4"} {
		c, err := dial(l, "h1/c1", network, to, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 2000)
		for i := range 300 {
			c.SetDeadline(time.Now().Add(2 * time.Second))
			msg := fmt.Appendf(nil, "%s message %d %0*d", network, i, i%1300, 0)
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			n := 0
			for n < len(msg) {
				m, err := c.Read(buf[n:])
				if err != nil {
					t.Fatalf("%s echo %d: %v", network, i, err)
				}
				n += m
			}
			if string(buf[:n]) != string(msg) {
				t.Fatalf("%s echo %d: %q", network, i, buf[:n])
			}
		}
		c.Close()
	}
	cmd, _ := l.Command(ctx, "h1/c1", "ping", "-c", "20", "-i", "0.01", "-W", "2", "-M", "do", "-s", "1400", dst.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("ping: %v\n%s", err, out)
	}
	after1, after2 := cacheStats(t, l, "h1"), cacheStats(t, l, "h2")
	// skiff layer cache lists the pair and the key each host gave.
	src, _ := l.IP("h1/c1")
	e1, e2 := cacheEntries(t, l, "h1"), cacheEntries(t, l, "h2")
	if !slices.ContainsFunc(e1.TunnelPairs, func(p cache.TunnelPair) bool {
		return p.Local == src && p.Remote == dst && p.Send != 0 && p.Recv != 0 && !p.Pending
	}) || !slices.ContainsFunc(e2.TunnelKeys, func(k cache.TunnelKey) bool { return k.Remote == src && k.Local == dst && !k.Dead }) {
		t.Errorf("h1's pairs %+v, h2's keys %+v: want h1/c1 → h2/c1 with keys both ways", e1.TunnelPairs, e2.TunnelKeys)
	}
	for k, v := range after1 {
		if v != before1[k] {
			t.Logf("h1 %s +%d", k, v-before1[k])
		}
	}
	for k, v := range after2 {
		if v != before2[k] {
			t.Logf("h2 %s +%d", k, v-before2[k])
		}
	}
	// 300 TCP and 300 UDP messages and 20 echoes each way, less a pair's
	// first packets (VXLAN) and TCP's handshake.
	for _, c := range []struct {
		host          string
		before, after map[string]uint64
	}{{"h1", before1, after1}, {"h2", before2, after2}} {
		sent, restored := counted(c.before, c.after, "from_container/rewritten"), counted(c.before, c.after, "from_underlay/restored")
		if sent < 550 || restored < 550 {
			t.Errorf("%s: %d packets sent rewritten, %d restored; want the bulk of 620 each way", c.host, sent, restored)
		}
		for _, bad := range []string{"from_underlay/rewrite_unknown_key", "from_underlay/rewrite_dead_key", "from_underlay/rewrite_spoofed", "from_underlay/restored_to_overlay"} {
			if n := counted(c.before, c.after, bad); n > 0 {
				t.Errorf("%s: %s +%d", c.host, bad, n)
			}
		}
	}
}

// TestRewriteDenyStopsFlow: a deny rule stops a flow that travels
// rewritten, as it stops one in VXLAN.
func TestRewriteDenyStopsFlow(t *testing.T) {
	l := newLab(t, Config{Name: "trwdeny", Hosts: 2, ContainersPerHost: 1, Mode: "cache", AgentArgs: rewriteArgs})
	s := startStream(t, l, "h1/c1", "h2/c1", 7300)
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	before := cacheStats(t, l, "h1")["from_container/rewritten"]
	time.Sleep(500 * time.Millisecond)
	if after := cacheStats(t, l, "h1")["from_container/rewritten"]; after == before {
		t.Fatal("the flow does not travel rewritten")
	}
	denyStops(t, l, s, "h2/c1", 7300)
}

// TestRewriteAgentRestart: a transfer survives restarts of both agents
// and keeps travelling rewritten (the tunnel's maps are pinned).
func TestRewriteAgentRestart(t *testing.T) {
	l := newLab(t, Config{Name: "trwrest", Hosts: 2, ContainersPerHost: 1, Mode: "cache", AgentArgs: rewriteArgs})
	s := startStream(t, l, "h1/c1", "h2/c1", 7400)
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	restartUnder(t, l, s, "h1", "h2")
	before := cacheStats(t, l, "h1")
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatalf("stalled after the restarts: %v", err)
	}
	after := cacheStats(t, l, "h1")
	if n := counted(before, after, "from_container/rewritten"); n == 0 {
		t.Errorf("after the restarts nothing travels rewritten (%d in VXLAN)", counted(before, after, "from_container/hit"))
	}
	if err := s.finish(); err != nil {
		t.Fatal(err)
	}
}

// TestRewriteNotForged: a container cannot forge a restore key. h1/c2
// sends datagrams with every key (DF, ID k<<6) to h2's underlay address,
// the ports of a pair h1/c1 → h2/c1 that travels rewritten: h1 scrubs
// them on the way out, and h2/c1 gets none of them.
func TestRewriteNotForged(t *testing.T) {
	l := newLab(t, Config{Name: "trwforge", Hosts: 2, ContainersPerHost: 2, Mode: "cache", AgentArgs: rewriteArgs})
	const port = 7710
	victim, _ := l.IP("h2/c1")
	var sock *net.UDPConn
	if err := l.Do("h2/c1", func() (err error) {
		sock, err = net.ListenUDP("udp4", &net.UDPAddr{Port: port})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer sock.Close()
	// The pair's keys, both ways: a datagram from h1/c1 and the reply.
	c, err := dial(l, "h1/c1", "udp4", netip.AddrPortFrom(victim, port), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 100)
	for i := range 5 {
		c.Write([]byte("real"))
		sock.SetReadDeadline(time.Now().Add(2 * time.Second))
		n, from, err := sock.ReadFromUDPAddrPort(buf)
		if err != nil || string(buf[:n]) != "real" {
			t.Fatalf("datagram %d: %q %v", i, buf[:n], err)
		}
		sock.WriteToUDPAddrPort([]byte("reply"), from)
		c.SetReadDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.Read(buf); err != nil {
			t.Fatal(err)
		}
	}
	before1 := cacheStats(t, l, "h1")
	c.Write([]byte("real"))
	if n := counted(before1, cacheStats(t, l, "h1"), "from_container/rewritten"); n != 1 {
		t.Fatalf("the pair does not travel rewritten (%d)", n)
	}
	sock.SetReadDeadline(time.Now().Add(2 * time.Second))
	sock.ReadFromUDPAddrPort(buf)
	sport := uint16(c.LocalAddr().(*net.UDPAddr).Port)
	h2, _ := l.Host("h2")
	src, _ := l.IP("h1/c2")
	before1, before2 := cacheStats(t, l, "h1"), cacheStats(t, l, "h2")
	if err := l.Do("h1/c2", func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		for k := uint16(1); k <= 511; k++ {
			pkt := tctest.IPv4(tctest.IPOpts{Frag: 0x4000, ID: k << 6}, tctest.ProtoUDP, src, h2.UnderlayIP, tctest.UDP(sport, port, []byte("forged")))
			if err := unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: h2.UnderlayIP.As4()}); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	sock.SetReadDeadline(time.Now().Add(time.Second))
	if n, from, err := sock.ReadFromUDPAddrPort(buf); err == nil {
		t.Errorf("h2/c1 got %q from %s", buf[:n], from)
	}
	after1, after2 := cacheStats(t, l, "h1"), cacheStats(t, l, "h2")
	scrubbed, restored := counted(before1, after1, "to_underlay/scrubbed"), counted(before2, after2, "from_underlay/restored")
	t.Logf("h1 scrubbed %d, h2 restored %d", scrubbed, restored)
	if scrubbed < 511 {
		t.Errorf("h1 scrubbed %d of the 511 forged datagrams", scrubbed)
	}
	if restored > 0 {
		t.Errorf("h2 restored %d packets", restored)
	}
}

// TestRewriteFullMTU: with the rewriting tunnel containers get the
// underlay's MTU. A full-size packet travels rewritten once the pair's keys
// are exchanged; before that (a cold pair's first datagram), and when it
// cannot go rewritten at all (an IP fragment), the overlay carries it in
// outer fragments.
func TestRewriteFullMTU(t *testing.T) {
	l := newLab(t, Config{Name: "trwmtu", Hosts: 2, ContainersPerHost: 2, Mode: "cache", AgentArgs: rewriteArgs})
	ctx := context.Background()
	var mtu int
	if err := l.Do("h1/c1", func() error {
		ifc, err := net.InterfaceByName("eth0")
		if err == nil {
			mtu = ifc.MTU
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if mtu != 1500 {
		t.Fatalf("container MTU %d, want the underlay's 1500", mtu)
	}
	// Small echoes between h1/c1 and h2/c1: the hosts' headers are known,
	// that pair's keys exchanged.
	dst, _ := l.IP("h2/c1")
	cmd, _ := l.Command(ctx, "h1/c1", "ping", "-c", "10", "-i", "0.01", "-W", "2", dst.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("ping: %v\n%s", err, out)
	}
	const port = 7720
	for _, size := range []int{1472, 4000} { // a cold pair's full-size datagram, then one in IP fragments
		dst, _ := l.IP("h2/c2")
		var sock *net.UDPConn
		if err := l.Do("h2/c2", func() (err error) {
			sock, err = net.ListenUDP("udp4", &net.UDPAddr{Port: port + size})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		c, err := dial(l, "h1/c2", "udp4", netip.AddrPortFrom(dst, uint16(port+size)), 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		before := cacheStats(t, l, "h1")
		if _, err := c.Write(make([]byte, size)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 5000)
		sock.SetReadDeadline(time.Now().Add(2 * time.Second))
		if n, _, err := sock.ReadFromUDPAddrPort(buf); err != nil || n != size {
			t.Errorf("a %d-byte datagram: got %d bytes, %v", size, n, err)
		}
		after := cacheStats(t, l, "h1")
		if n := counted(before, after, "from_container/too_big_for_vxlan"); size == 1472 && n != 1 {
			t.Errorf("a cold pair's full-size datagram: %d too big for VXLAN, want 1 (to the overlay)", n)
		}
		c.Close()
		sock.Close()
	}
	// Full-size echoes both ways on the warm pair: rewritten.
	before := cacheStats(t, l, "h1")
	cmd, _ = l.Command(ctx, "h1/c1", "ping", "-c", "20", "-i", "0.01", "-W", "2", "-M", "do", "-s", "1472", dst.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("ping: %v\n%s", err, out)
	}
	if n := counted(before, cacheStats(t, l, "h1"), "from_container/rewritten"); n < 18 {
		t.Errorf("%d of 20 full-size echo requests went rewritten", n)
	}
}
