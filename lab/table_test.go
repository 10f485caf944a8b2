package lab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/policy"
)

// conntrackOf counts the conntrack entries of a host's namespace for
// flows between a and b (TCP, UDP and ICMP).
func conntrackOf(t *testing.T, l *Lab, host string, a, b netip.Addr) int {
	t.Helper()
	n := 0
	err := l.Do(host, func() error {
		flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
		if err != nil {
			return err
		}
		for _, f := range flows {
			src, _ := netip.AddrFromSlice(f.Forward.SrcIP.To4())
			dst, _ := netip.AddrFromSlice(f.Forward.DstIP.To4())
			if src == a && dst == b || src == b && dst == a {
				n++
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestCacheFirstPacket: in cache mode, with no preload and no profile, a
// connection takes the fast path from its first SYN on both hosts (the
// connection table): 10 000 sequential connections, none failed,
// none seen by either host's conntrack; a deny rule judges the first SYN
// the same way the overlay does.
func TestCacheFirstPacket(t *testing.T) {
	l := newLab(t, Config{Name: "tfirst", Hosts: 2, ContainersPerHost: 1, Mode: "cache"})
	echoServer(t, l, "h2/c1", echoPort)
	src, _ := l.IP("h1/c1")
	dst, _ := l.IP("h2/c1")
	to := netip.AddrPortFrom(dst, echoPort)
	// The first connection may find the underlay's next hop unresolved
	// (its headers are learned from the overlay then); after it, every
	// path is known.
	if err := exchange(l, "h1/c1", "tcp4", to); err != nil {
		t.Fatal(err)
	}
	if err := l.FlushConntrack(); err != nil {
		t.Fatal(err)
	}
	before1, before2 := cacheStats(t, l, "h1"), cacheStats(t, l, "h2")
	const conns = 10000
	failed := sequentialConnections(t, l, "h1/c1", to, conns)
	if failed > 0 {
		t.Errorf("%d of %d connections failed", failed, conns)
	}
	after1, after2 := cacheStats(t, l, "h1"), cacheStats(t, l, "h2")
	opened1 := after1["from_container/table_open"] - before1["from_container/table_open"]
	opened2 := after2["from_underlay/table_open"] - before2["from_underlay/table_open"]
	t.Logf("connections opened in the table: %d on h1 (outbound), %d on h2 (inbound)", opened1, opened2)
	if opened1 < conns || opened2 < conns {
		t.Errorf("table opened %d (h1) and %d (h2) of %d connections; h1 %v; h2 %v", opened1, opened2, conns,
			diff(before1, after1), diff(before2, after2))
	}
	datagramsAndPings(t, l, "h1/c1", to, "from_container/table_open")
	for _, h := range []string{"h1", "h2"} {
		if n := conntrackOf(t, l, h, src, dst); n > 0 {
			t.Errorf("%s's conntrack holds %d entries of fast-pathed flows", h, n)
		}
	}

	// A deny rule: the first SYN is judged denied and left to the overlay,
	// which rejects it.
	rule := policy.Rule{ID: "no-echo", Priority: 10, Action: policy.Deny, Src: netip.PrefixFrom(src, 32),
		Dst: netip.PrefixFrom(dst, 32), Proto: policy.TCP, Port: echoPort}
	if err := l.PutPolicy(context.Background(), rule); err != nil {
		t.Fatal(err)
	}
	if _, err := eventually(converges, func() error {
		if _, err := dial(l, "h1/c1", "tcp4", to, 300*time.Millisecond); err == nil {
			return errors.New("connection still allowed")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// Once the rule reached the fast path (the overlay may enforce it a
	// moment earlier), the fast path judges the SYN itself.
	if _, err := eventually(converges, func() error {
		if _, err := dial(l, "h1/c1", "tcp4", to, 300*time.Millisecond); err == nil {
			t.Fatal("a denied connection was let through")
		}
		if cacheStats(t, l, "h1")["from_container/new_denied"] == 0 {
			return errors.New("no SYN judged denied on h1")
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	// The overlay rejected them, and counts them by rule; a reconcile that
	// leaves the rules as they are keeps the count.
	denies := func() (uint64, uint64) {
		st, err := agentOf(t, l, "h1").Status(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return st.PolicyDenies[rule.ID], st.Reconciles
	}
	n, reconciles := denies()
	if n == 0 {
		t.Fatal("h1 counts no packet denied by the rule")
	}
	if err := l.PutPolicy(context.Background(), rule); err != nil {
		t.Fatal(err)
	}
	if _, err := eventually(converges, func() error {
		if m, r := denies(); r == reconciles {
			return errors.New("no reconcile")
		} else if m < n {
			t.Fatalf("a reconcile zeroed the rule's count: %d, was %d", m, n)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
}

// diff is the counters that moved.
func diff(before, after map[string]uint64) map[string]uint64 {
	d := map[string]uint64{}
	for k, v := range after {
		if v != before[k] {
			d[k] = v - before[k]
		}
	}
	return d
}

// TestCacheHeadersFromStore: the outer headers the agent builds for a
// remote host from the store, its routes and neighbours are the ones the
// overlay's VXLAN device puts on that host's packets (those learned from
// them), but for the fields the fast path writes per packet.
func TestCacheHeadersFromStore(t *testing.T) {
	l := newLab(t, Config{Name: "thdr", Hosts: 2, ContainersPerHost: 1, Mode: "cache"})
	h2, _ := l.Host("h2")
	m, err := ebpf.LoadPinnedMap(filepath.Join(l.bpfDir("h1"), "cache", "skc_egress_host"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	header := func() ([]byte, error) {
		v := make([]byte, m.ValueSize())
		if err := m.Lookup(h2.UnderlayIP.As4(), &v); err != nil {
			return nil, err
		}
		// Lengths, IP ID and checksum, UDP source port: per packet.
		for _, f := range [][2]int{{16, 18}, {18, 20}, {24, 26}, {34, 36}, {38, 40}} {
			clear(v[f[0]:f[1]])
		}
		return v, nil
	}
	// The next hop resolved (here by a ping of h2's underlay address),
	// the next reconcile (here a rule that changes nothing) builds them.
	if err := l.Do("h1", func() error { return exec.Command("ping", "-c", "1", "-W", "1", h2.UnderlayIP.String()).Run() }); err != nil {
		t.Fatal(err)
	}
	if err := l.PutPolicy(context.Background(), policy.Rule{ID: "noop", Action: policy.Allow, Priority: 5, Proto: policy.UDP, Port: 9}); err != nil {
		t.Fatal(err)
	}
	var built []byte
	if _, err := eventually(converges, func() (err error) { built, err = header(); return err }); err != nil {
		t.Fatalf("no headers for h2 built: %v", err)
	}
	if err := m.Delete(h2.UnderlayIP.As4()); err != nil {
		t.Fatal(err)
	}
	// Overlay traffic established in both directions teaches them again.
	dst, _ := l.IP("h2/c1")
	cmd, _ := l.Command(context.Background(), "h1/c1", "ping", "-c", "5", "-i", "0.01", dst.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	learned, err := header()
	if err != nil {
		t.Fatalf("no headers learned: %v", err)
	}
	if !bytes.Equal(built, learned) {
		t.Errorf("headers built from the store differ from the overlay's:\nbuilt   %x\nlearned %x", built, learned)
	}
}

// TestCacheRestartDuringConnections: short connections run on while both
// agents restart: the table is pinned, connections opened before carry on,
// SYNs that find no policy compiled yet take the overlay, and none fails.
func TestCacheRestartDuringConnections(t *testing.T) {
	l := newLab(t, Config{Name: "tcrr", Hosts: 2, ContainersPerHost: 1, Mode: "cache"})
	ctx := context.Background()
	echoServer(t, l, "h2/c1", echoPort)
	dst, _ := l.IP("h2/c1")
	to := netip.AddrPortFrom(dst, echoPort)
	stop := make(chan struct{})
	type result struct{ ok, failed int }
	done := make(chan result)
	go func() {
		var r result
		l.Do("h1/c1", func() error {
			buf := make([]byte, 16)
			for {
				select {
				case <-stop:
					return nil
				default:
				}
				c, err := net.DialTimeout("tcp4", to.String(), 2*time.Second)
				if err != nil {
					r.failed++
					continue
				}
				c.SetDeadline(time.Now().Add(2 * time.Second))
				if _, err := c.Write([]byte("x")); err != nil {
					r.failed++
				} else if n, err := c.Read(buf); err != nil || n != 1 {
					r.failed++
				} else {
					r.ok++
				}
				c.Close()
			}
		})
		done <- r
	}()
	time.Sleep(300 * time.Millisecond)
	for _, h := range []string{"h2", "h1"} {
		if err := l.StopAgent(ctx, h); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		if err := l.StartAgent(ctx, h); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(500 * time.Millisecond)
	close(stop)
	r := <-done
	t.Logf("%d connections, %d failed", r.ok+r.failed, r.failed)
	if r.failed > 0 || r.ok == 0 {
		t.Errorf("%d of %d connections failed across the restarts", r.failed, r.ok+r.failed)
	}
	st := cacheStats(t, l, "h1")
	if st["from_container/table_open"] == 0 {
		t.Error("no connection opened in the table")
	}
}

// TestCacheLocalConnections: TCP between two containers of one host goes
// by the connection table from its first SYN, past the bridge and
// conntrack; a deny rule is judged on its SYN.
func TestCacheLocalConnections(t *testing.T) {
	l := newLab(t, Config{Name: "tlocal", Hosts: 1, ContainersPerHost: 2, Mode: "cache"})
	echoServer(t, l, "h1/c2", echoPort)
	src, _ := l.IP("h1/c1")
	dst, _ := l.IP("h1/c2")
	to := netip.AddrPortFrom(dst, echoPort)
	if err := l.FlushConntrack(); err != nil {
		t.Fatal(err)
	}
	before := cacheStats(t, l, "h1")
	const conns = 2000
	if failed := sequentialConnections(t, l, "h1/c1", to, conns); failed > 0 {
		t.Errorf("%d of %d connections failed", failed, conns)
	}
	after := cacheStats(t, l, "h1")
	if opened := after["from_container/local_table_open"] - before["from_container/local_table_open"]; opened < conns {
		t.Errorf("table opened %d of %d connections: %v", opened, conns, diff(before, after))
	}
	datagramsAndPings(t, l, "h1/c1", to, "from_container/local_table_open")
	if n := conntrackOf(t, l, "h1", src, dst); n > 0 {
		t.Errorf("conntrack holds %d entries of table flows", n)
	}
	rule := policy.Rule{ID: "no-echo", Priority: 10, Action: policy.Deny, Dst: netip.PrefixFrom(dst, 32), Proto: policy.TCP, Port: echoPort}
	if err := l.PutPolicy(context.Background(), rule); err != nil {
		t.Fatal(err)
	}
	if _, err := eventually(converges, func() error {
		if _, err := dial(l, "h1/c1", "tcp4", to, 300*time.Millisecond); err == nil {
			return errors.New("connection still allowed")
		}
		if cacheStats(t, l, "h1")["from_container/local_new_denied"] == 0 {
			return errors.New("no SYN judged denied")
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
}

// datagramsAndPings sends UDP queries from src to to, each from a new
// socket (a new flow), and pings to's address, and checks that every one
// was answered and that each query and the first ping opened a flow in the
// table (the counter opened, on src's host; a later ping may reuse an
// identifier, and so the first one's flow).
func datagramsAndPings(t *testing.T, l *Lab, src string, to netip.AddrPort, opened string) {
	t.Helper()
	host, _, _ := strings.Cut(src, "/")
	before := cacheStats(t, l, host)
	const queries, pings = 200, 3
	for i := range queries {
		if err := exchange(l, src, "udp4", to); err != nil {
			t.Fatalf("UDP query %d: %v", i, err)
		}
	}
	for range pings {
		if err := ping(context.Background(), l, src, to.Addr()); err != nil {
			t.Fatal(err)
		}
	}
	after := cacheStats(t, l, host)
	if n := after[opened] - before[opened]; n < queries+1 {
		t.Errorf("%d UDP and ICMP flows opened in the table, want %d at least: %v", n, queries+1, diff(before, after))
	}
}

// sequentialConnections opens n connections one after the other from src
// to to, each carrying one echoed message, and returns how many failed.
func sequentialConnections(t *testing.T, l *Lab, src string, to netip.AddrPort, n int) int {
	t.Helper()
	failed := 0
	err := l.Do(src, func() error {
		buf := make([]byte, 16)
		for i := range n {
			c, err := net.DialTimeout("tcp4", to.String(), 2*time.Second)
			if err != nil {
				failed++
				continue
			}
			c.SetDeadline(time.Now().Add(2 * time.Second))
			msg := fmt.Sprint(i)
			if _, err := c.Write([]byte(msg)); err != nil {
				failed++
			} else if n, err := c.Read(buf); err != nil || string(buf[:n]) != msg {
				failed++
			}
			c.Close()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return failed
}

// TestCacheServiceDNAT: a UDP flow to a virtual address that the client's
// host DNATs to a container on another host (what kube-proxy makes of a
// ClusterIP Service) answers from the virtual address, in cache and auto
// mode: the backend's answer looks like a new flow between two
// containers, and the connection table must leave it to the NAT that made
// it. TCP through the same address works too (its SYN is the client's, to
// the virtual address: the overlay's). A deny rule ends a connection that
// runs through such an address: the policy judges where it went after the
// NAT, as the policy chain did.
func TestCacheServiceDNAT(t *testing.T) {
	for _, mode := range []string{"cache", "auto"} {
		t.Run(mode, func(t *testing.T) {
			l := newLab(t, Config{Name: "tsvc" + mode[:1], Hosts: 2, ContainersPerHost: 2, Mode: mode})
			echoServer(t, l, "h2/c1", echoPort)
			dnat := func(proto string, vip netip.AddrPort, to string, port int) {
				t.Helper()
				backend, _ := l.IP(to)
				cmd, err := l.Command(context.Background(), "h1", "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip.Addr().String(),
					"-p", proto, "--dport", fmt.Sprint(vip.Port()), "-j", "DNAT", "--to-destination", netip.AddrPortFrom(backend, uint16(port)).String())
				if err != nil {
					t.Fatal(err)
				}
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Fatalf("DNAT rule: %v: %s", err, out)
				}
			}
			vip := netip.AddrPortFrom(netip.MustParseAddr("10.96.0.10"), 53)
			dnat("udp", vip, "h2/c1", echoPort)
			dnat("tcp", vip, "h2/c1", echoPort)
			// Until h1 knows the backend's host and its headers, its
			// table could not take the answer anyway.
			backend, _ := l.IP("h2/c1")
			if _, err := eventually(converges, func() error {
				if err := exchange(l, "h1/c1", "tcp4", netip.AddrPortFrom(backend, echoPort)); err != nil {
					return err
				}
				e := cacheEntries(t, l, "h1")
				if !slices.ContainsFunc(e.EgressIPs, func(x cache.EgressIP) bool { return x.Container == backend }) || len(e.EgressHosts) == 0 {
					return fmt.Errorf("h1's cache has no path to %s yet: %+v", backend, e)
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			if err := queryUnconnected(l, "h1/c1", vip, 50); err != nil {
				t.Errorf("UDP through the virtual address: %v", err)
			}

			for i := range 20 {
				if err := exchange(l, "h1/c1", "tcp4", vip); err != nil {
					t.Fatalf("TCP connection %d through the virtual address: %v", i, err)
				}
			}
			// A connection to a backend on the client's own host, all in
			// that host's conntrack: the deny rule must end it there.
			web := netip.AddrPortFrom(netip.MustParseAddr("10.96.0.11"), 80)
			dnat("tcp", web, "h1/c2", 7201)
			s := startStreamVia(t, l, "h1/c1", "h1/c2", 7201, web)
			defer s.finish()
			if err := s.progresses(time.Second); err != nil {
				t.Fatal(err)
			}
			c2, _ := l.IP("h1/c2")
			rule := policy.Rule{ID: "cut", Priority: 1, Action: policy.Deny, Dst: netip.PrefixFrom(c2, 32), Proto: policy.TCP, Port: 7201}
			if err := l.PutPolicy(context.Background(), rule); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Second)
			if err := s.progresses(time.Second); err == nil {
				t.Error("the connection through the virtual address still moves 1 s after the deny rule")
			}
		})
	}
}
