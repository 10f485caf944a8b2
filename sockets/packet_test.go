package sockets

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/tc/tctest"
)

// Golden-packet tests (BPF_PROG_RUN) of the tc and sk_lookup programs.

// next is TC_ACT_UNSPEC: a packet a program does not take goes on to the
// device's next program (another layer's), which decides.
const next = ^uint32(0)

var (
	macA = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0a}
	macB = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0b}

	ipServer = netip.MustParseAddr("10.244.1.5") // container on this host (testHost)
	ipClient = netip.MustParseAddr("10.244.2.7") // container on the peer host
	ulPeer   = netip.MustParseAddr("10.99.0.2")
	ulOther  = netip.MustParseAddr("10.99.0.3")
	subnetB  = netip.MustParsePrefix("10.244.2.0/24")
)

// synOption is the option sockops writes: kind 253, length 14, magic 0x5352,
// overlay destination address and port, overlay source.
func synOption(dst netip.AddrPort, src netip.Addr) []byte {
	o := []byte{253, 14, 0x53, 0x52}
	d, s := dst.Addr().As4(), src.As4()
	o = append(o, d[:]...)
	o = binary.BigEndian.AppendUint16(o, dst.Port())
	return append(o, s[:]...)
}

// linuxSYNOptions are the options Linux puts before ours: MSS, SACK-permitted,
// timestamps, NOP, window scale (20 bytes).
var linuxSYNOptions = []byte{2, 4, 5, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 10}

func syn(src, dst netip.Addr, flags byte, opts []byte) []byte {
	return tctest.Eth(macB, macA, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, src, dst,
		tctest.TCPWithOptions(40000, 8080, flags, opts, nil)))
}

// withPeer makes the peer host own subnet B.
func withPeer(t testing.TB, l *dataPlane) {
	t.Helper()
	hosts := []cluster.Host{testHost, {Name: "h2", UnderlayIP: ulPeer, Subnet: subnetB}}
	if err := l.Sync(hosts, nil, nil); err != nil {
		t.Fatal(err)
	}
}

func pendingEntry(t *testing.T, l *dataPlane, saddr, daddr netip.Addr) (sksSksPending, bool) {
	t.Helper()
	k := sksSksTuple{Saddr: bpfmap.IPv4(saddr), Daddr: bpfmap.IPv4(daddr), Sport: bpfmap.Port(40000), Dport: bpfmap.Port(8080)}
	var v sksSksPending
	err := l.objs.SksSyns.Lookup(k, &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return v, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return v, true
}

func TestFromUnderlay(t *testing.T) {
	l := loadTest(t)
	withPeer(t, l)
	server := netip.AddrPortFrom(ipServer, 8080)
	good := append(append([]byte{}, linuxSYNOptions...), synOption(server, ipClient)...)
	cases := []struct {
		name    string
		pkt     []byte
		verdict uint32
		record  bool
		reason  string
	}{
		{"option SYN from the client's host", syn(ulPeer, testHost.UnderlayIP, tctest.SYN, good), next, true, "syn_recorded"},
		{"option alone", syn(ulPeer, testHost.UnderlayIP, tctest.SYN, synOption(server, ipClient)), next, true, "syn_recorded"},
		{"claims a container of another host", syn(ulOther, testHost.UnderlayIP, tctest.SYN, good), 2, false, "syn_spoofed"},
		{"claims an unknown container", syn(ulPeer, testHost.UnderlayIP, tctest.SYN,
			synOption(server, netip.MustParseAddr("10.244.9.9"))), 2, false, "syn_spoofed"},
		{"destination not on this host", syn(ulPeer, testHost.UnderlayIP, tctest.SYN,
			synOption(netip.AddrPortFrom(ipClient, 80), ipClient)), 2, false, "syn_malformed"},
		{"plain SYN", syn(ulPeer, testHost.UnderlayIP, tctest.SYN, linuxSYNOptions), next, false, ""},
		{"SYN-ACK with the option", syn(ulPeer, testHost.UnderlayIP, tctest.SYN|tctest.ACK, good), next, false, ""},
		{"option not at the end", syn(ulPeer, testHost.UnderlayIP, tctest.SYN,
			append(synOption(server, ipClient), linuxSYNOptions...)), next, false, ""},
		{"bad magic", syn(ulPeer, testHost.UnderlayIP, tctest.SYN, append([]byte{253, 14, 0x53, 0x53}, synOption(server, ipClient)[4:]...)), next, false, ""},
		{"truncated TCP header", syn(ulPeer, testHost.UnderlayIP, tctest.SYN, good)[:14+20+30], next, false, ""},
		{"IPv6", tctest.Eth(macB, macA, 0x86dd, make([]byte, 80)), next, false, ""},
		{"ARP", tctest.Eth(macB, macA, 0x0806, make([]byte, 28)), next, false, ""},
		// Straight to a container, not through the overlay: only steered
		// packets may carry the route's TOS.
		{"the route's TOS to a container", tctest.Eth(macB, macA, 0x0800, tctest.IPv4(tctest.IPOpts{TOS: 0x1c},
			tctest.ProtoTCP, ulPeer, ipServer, tctest.TCP(40000, 8080, tctest.SYN, nil))), next, false, "tos_cleared"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			l.objs.SksSyns.Delete(sksSksTuple{Saddr: bpfmap.IPv4(ulPeer), Daddr: bpfmap.IPv4(testHost.UnderlayIP), Sport: bpfmap.Port(40000), Dport: bpfmap.Port(8080)})
			before, _ := l.Stats()
			verdict, out := tctest.Run(t, l.objs.SksFromUnderlay, c.pkt)
			if verdict != c.verdict {
				t.Fatalf("verdict %d, want %d", verdict, c.verdict)
			}
			want := append([]byte{}, c.pkt...)
			if c.reason == "tos_cleared" {
				withTOS(want[14:34], 0x18)
			}
			if !bytes.Equal(out[:len(want)], want) {
				t.Fatalf("packet\n%x\nwant\n%x", out[:len(want)], want)
			}
			p, ok := pendingEntry(t, l, ulPeer, testHost.UnderlayIP)
			if ok != c.record {
				t.Fatalf("recorded=%v, want %v", ok, c.record)
			}
			if ok && (p.DstIp != bpfmap.IPv4(ipServer) || p.SrcIp != bpfmap.IPv4(ipClient) || p.DstPort != bpfmap.Port(8080)) {
				t.Fatalf("recorded %+v", p)
			}
			after, _ := l.Stats()
			if c.reason != "" && after[c.reason] != before[c.reason]+1 {
				t.Fatalf("counter %s %d → %d", c.reason, before[c.reason], after[c.reason])
			}
		})
	}
	// A record outlives a handshake that failed (the client's RST ends
	// the request, not the record). A plain SYN of the same 4-tuple is
	// the host's own: it removes the record, which would steer it to the
	// container.
	tctest.Run(t, l.objs.SksFromUnderlay, syn(ulPeer, testHost.UnderlayIP, tctest.SYN, good))
	if _, ok := pendingEntry(t, l, ulPeer, testHost.UnderlayIP); !ok {
		t.Fatal("option SYN not recorded")
	}
	if verdict, _ := tctest.Run(t, l.objs.SksFromUnderlay, syn(ulPeer, testHost.UnderlayIP, tctest.SYN, linuxSYNOptions)); verdict != next {
		t.Fatalf("plain SYN: verdict %d", verdict)
	}
	if _, ok := pendingEntry(t, l, ulPeer, testHost.UnderlayIP); ok {
		t.Fatal("a plain SYN of a recorded 4-tuple left the record")
	}
}

// BenchmarkFromUnderlay times the recorder in the kernel (BPF_PROG_RUN, hot
// caches) on what a connection brings the server's host: the option SYN,
// whose record it writes, and the plain segments, which it only parses.
func BenchmarkFromUnderlay(b *testing.B) {
	l := loadTestTB(b)
	withPeer(b, l)
	good := append(append([]byte{}, linuxSYNOptions...), synOption(netip.AddrPortFrom(ipServer, 8080), ipClient)...)
	for _, c := range []struct {
		name string
		pkt  []byte
	}{
		{"option SYN", syn(ulPeer, testHost.UnderlayIP, tctest.SYN, good)},
		{"plain SYN", syn(ulPeer, testHost.UnderlayIP, tctest.SYN, linuxSYNOptions)},
		{"ACK", syn(ulPeer, testHost.UnderlayIP, tctest.ACK, nil)},
	} {
		b.Run(c.name, func(b *testing.B) {
			_, per, err := l.objs.SksFromUnderlay.Benchmark(c.pkt, b.N, nil)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(per.Nanoseconds()), "ns/run")
		})
	}
}

// A container's own SYN with the option is forged (only sockops writes it,
// on host sockets): dropped on the container's veth, wherever it goes.
func TestFromContainerForgedSYN(t *testing.T) {
	l := loadTest(t)
	opt := append(append([]byte{}, linuxSYNOptions...), synOption(netip.AddrPortFrom(ipClient, 8080), ipServer)...)
	cases := []struct {
		name    string
		pkt     []byte
		verdict uint32
	}{
		{"option SYN to another host", syn(ipServer, ulPeer, tctest.SYN, opt), 2},
		{"option SYN to a container", syn(ipServer, ipClient, tctest.SYN, opt), 2},
		{"plain SYN", syn(ipServer, ulPeer, tctest.SYN, linuxSYNOptions), next},
		{"SYN-ACK with the option", syn(ipServer, ulPeer, tctest.SYN|tctest.ACK, opt), next},
	}
	for _, c := range cases {
		before, _ := l.Stats()
		if verdict, _ := tctest.Run(t, l.objs.SksFromContainer, c.pkt); verdict != c.verdict {
			t.Errorf("%s: verdict %d, want %d", c.name, verdict, c.verdict)
		}
		after, _ := l.Stats()
		if forged, dropped := after["syn_forged"]-before["syn_forged"], c.verdict == 2; forged != 0 != dropped {
			t.Errorf("%s: syn_forged +%d", c.name, forged)
		}
	}
}

// listener returns a TCP listener on loopback, as bind4 leaves a replaced
// one, and its socket cookie.
func listener(t *testing.T) (int, uint64) {
	t.Helper()
	fd := listenOn(t, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), 0))
	cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		t.Fatal(err)
	}
	return fd, cookie
}

// listenOn returns a TCP socket listening on at, closed when the test ends.
func listenOn(t *testing.T, at netip.AddrPort) int {
	t.Helper()
	fd := tcpSocket(t)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: at.Addr().As4(), Port: int(at.Port())}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 16); err != nil {
		t.Fatal(err)
	}
	return fd
}

func tcpSocket(t *testing.T) int {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

func publish(t *testing.T, l *dataPlane, fd int, at netip.AddrPort) {
	t.Helper()
	if err := l.objs.SksServed.Put(bpfmap.IPv4(at.Addr()), uint8(1)); err != nil {
		t.Fatal(err)
	}
	if err := l.objs.SksListen.Put(sksSksKey{Ip: bpfmap.IPv4(at.Addr()), Port: bpfmap.Port(at.Port())}, uint64(fd)); err != nil {
		t.Fatal(err)
	}
}

// skLookup is struct bpf_sk_lookup.
type skLookup struct {
	Cookie         uint64
	Family         uint32
	Protocol       uint32
	RemoteIP4      [4]byte
	RemoteIP6      [16]byte
	RemotePort     uint16 // network order
	_              uint16
	LocalIP4       [4]byte
	LocalIP6       [16]byte
	LocalPort      uint32 // host order
	IngressIfindex uint32
	_              uint32 // the C struct's tail padding
}

// lookup runs sk_lookup for a SYN from → to and returns the socket it
// assigns, failing the test unless the verdict is SK_PASS.
func lookup(t *testing.T, l *dataPlane, from, to netip.AddrPort) uint64 {
	t.Helper()
	cookie, verdict := lookupVerdict(t, l, syscall.IPPROTO_TCP, from, to)
	if verdict != 1 {
		t.Fatalf("sk_lookup returned %d, want SK_PASS", verdict)
	}
	return cookie
}

func lookupVerdict(t *testing.T, l *dataPlane, proto uint32, from, to netip.AddrPort) (uint64, uint32) {
	t.Helper()
	in := skLookup{Family: syscall.AF_INET, Protocol: proto, RemoteIP4: from.Addr().As4(),
		RemotePort: bpfmap.Port(from.Port()), LocalIP4: to.Addr().As4(), LocalPort: uint32(to.Port())}
	var out skLookup
	ret, err := l.objs.SksLookup.Run(&ebpf.RunOptions{Context: in, ContextOut: &out})
	if err != nil {
		t.Fatal(err)
	}
	return out.Cookie, ret
}

func TestLookup(t *testing.T) {
	l := loadTest(t)
	withPeer(t, l)
	ln, cookie := listener(t)
	server := netip.AddrPortFrom(ipServer, 8080)
	client := netip.AddrPortFrom(ulPeer, 40000)
	host := netip.AddrPortFrom(testHost.UnderlayIP, 8080)

	if got := lookup(t, l, client, host); got != 0 {
		t.Fatalf("plain SYN assigned to %d", got)
	}
	// A recorded option SYN without its listener: no socket (the kernel
	// answers with a RST), never a host socket on the port.
	pkt := syn(ulPeer, testHost.UnderlayIP, tctest.SYN, append(append([]byte{}, linuxSYNOptions...), synOption(server, ipClient)...))
	tctest.Run(t, l.objs.SksFromUnderlay, pkt)
	before, _ := l.Stats()
	if got, verdict := lookupVerdict(t, l, syscall.IPPROTO_TCP, client, host); got != 0 || verdict != 0 {
		t.Fatalf("without a listener: assigned to %d, verdict %d; want none, SK_DROP", got, verdict)
	}
	if after, _ := l.Stats(); after["no_listener"] != before["no_listener"]+1 {
		t.Fatal("no_listener not counted")
	}
	// The refused SYN's record is gone: the same tuple, plain, is the
	// host's even once the listener is there.
	publish(t, l, ln, server)
	if got, verdict := lookupVerdict(t, l, syscall.IPPROTO_TCP, client, host); got != 0 || verdict != 1 {
		t.Fatalf("after the refusal: assigned to %d, verdict %d; want the host's lookup (SK_PASS)", got, verdict)
	}
	tctest.Run(t, l.objs.SksFromUnderlay, pkt) // the client's retransmit
	if got := lookup(t, l, client, host); got != cookie {
		t.Fatalf("recorded SYN assigned to %d, want the listener %d", got, cookie)
	}
	// The entry stays for the handshake's ACK (syncookies) and retransmits.
	if got := lookup(t, l, client, host); got != cookie {
		t.Fatalf("second lookup assigned to %d", got)
	}
	// Overlay traffic routed to the host stack: by overlay address.
	if got := lookup(t, l, netip.AddrPortFrom(ipClient, 40000), server); got != cookie {
		t.Fatalf("overlay SYN assigned to %d, want %d", got, cookie)
	}
	// A container's address without a replaced listener: no host socket
	// takes the connection (SK_DROP), and the refusal is counted.
	before, _ = l.Stats()
	if got, verdict := lookupVerdict(t, l, syscall.IPPROTO_TCP, netip.AddrPortFrom(ipClient, 40000), netip.AddrPortFrom(ipServer, 8081)); got != 0 || verdict != 0 {
		t.Fatalf("other port: assigned to %d, verdict %d; want none, SK_DROP", got, verdict)
	}
	// Nor a datagram: only a forged TOS takes one to the host stack.
	if got, verdict := lookupVerdict(t, l, syscall.IPPROTO_UDP, netip.AddrPortFrom(ipClient, 40000), netip.AddrPortFrom(ipServer, 53)); got != 0 || verdict != 0 {
		t.Fatalf("UDP to a container: assigned to %d, verdict %d; want none, SK_DROP", got, verdict)
	}
	if after, _ := l.Stats(); after["overlay_refused"] != before["overlay_refused"]+2 {
		t.Fatalf("overlay_refused %d → %d, want two refusals", before["overlay_refused"], after["overlay_refused"])
	}
	// UDP for the host's own addresses is the host's (VXLAN among it).
	if got, verdict := lookupVerdict(t, l, syscall.IPPROTO_UDP, netip.AddrPortFrom(ulPeer, 40000), netip.AddrPortFrom(testHost.UnderlayIP, 4789)); got != 0 || verdict != 1 {
		t.Fatalf("UDP to the host: assigned to %d, verdict %d; want none, SK_PASS", got, verdict)
	}
	// The subnet's first two addresses are the host's (VXLAN device,
	// bridge): the host's own sockets answer there.
	for _, a := range []string{"10.244.1.0", "10.244.1.1"} {
		if got := lookup(t, l, netip.AddrPortFrom(ipClient, 40000), netip.AddrPortFrom(netip.MustParseAddr(a), 8080)); got != 0 {
			t.Fatalf("%s assigned to %d", a, got)
		}
	}
	// A same-host connection (SameHostAddr at both ends): its client's
	// record steers it; without one (evicted, or a connect that failed) it
	// is refused, never the host's lookup, which would find a host
	// listener on every address.
	same := netip.AddrPortFrom(SameHostAddr, 41000)
	to := netip.AddrPortFrom(SameHostAddr, 8080)
	before, _ = l.Stats()
	if got, verdict := lookupVerdict(t, l, syscall.IPPROTO_TCP, same, to); got != 0 || verdict != 0 {
		t.Fatalf("same-host SYN without its record: assigned to %d, verdict %d; want none, SK_DROP", got, verdict)
	}
	if after, _ := l.Stats(); after["same_host_unrecorded"] != before["same_host_unrecorded"]+1 {
		t.Fatal("same_host_unrecorded not counted")
	}
	rec := sksSksTuple{Saddr: bpfmap.IPv4(SameHostAddr), Daddr: bpfmap.IPv4(SameHostAddr), Sport: bpfmap.Port(same.Port()), Dport: bpfmap.Port(to.Port())}
	if err := l.objs.SksSyns.Put(rec, sksSksPending{DstIp: bpfmap.IPv4(ipServer), SrcIp: bpfmap.IPv4(ipClient), DstPort: bpfmap.Port(8080)}); err != nil {
		t.Fatal(err)
	}
	if got := lookup(t, l, same, to); got != cookie {
		t.Fatalf("recorded same-host SYN assigned to %d, want the listener %d", got, cookie)
	}
}

// TestToHostStack runs in a network namespace of its own, so that it can
// hold real connections and a host listener for the programs' socket
// lookups to find: the test's thread enters it and is discarded at the end.
func TestToHostStack(t *testing.T) {
	l := loadTest(t)
	// A container of this host that never had a replaced listener.
	ipOther := netip.MustParseAddr("10.244.1.9")
	ownNetns(t, ipServer, ipClient, ipOther)
	ln, _ := listener(t)
	publish(t, l, ln, netip.AddrPortFrom(ipServer, 8080))
	// A connection accepted from a replaced listener (its local address is
	// the container's), and a host listener on every address, port 8082.
	conn := connection(t, netip.AddrPortFrom(ipServer, 8081), ipClient)
	listenOn(t, netip.AddrPortFrom(netip.IPv4Unspecified(), 8082))
	// Only a replaced listener's connections are the host stack's; the
	// test makes one for a container that never had one, to show that
	// its traffic is not even looked up.
	otherConn := connection(t, netip.AddrPortFrom(ipOther, 8086), ipClient)

	segTOS := func(tos byte, src netip.AddrPort, dst netip.Addr, port uint16, flags byte) []byte {
		return tctest.Eth(macB, macA, 0x0800, tctest.IPv4(tctest.IPOpts{TOS: tos}, tctest.ProtoTCP, src.Addr(), dst,
			tctest.TCP(src.Port(), port, flags, []byte("x"))))
	}
	seg := func(src netip.AddrPort, dst netip.Addr, port uint16, flags byte) []byte {
		return segTOS(0, src, dst, port, flags)
	}
	client := netip.AddrPortFrom(ipClient, 40000)
	gateway := netip.MustParseAddr("10.244.1.1")
	const steered = HostStackTOS
	// A replaced listener under a SYN flood answers with a syncookie and
	// keeps nothing: the ACK that completes the handshake finds no
	// connection, and the listener's cookie must take it to the host stack.
	cookieClient := netip.AddrPortFrom(ipClient, 40002)
	publish(t, l, listenOn(t, netip.AddrPortFrom(ipServer, 8085)), netip.AddrPortFrom(ipServer, 8085))
	cookieACK := syncookieACK(t, cookieClient, netip.AddrPortFrom(ipServer, 8085))
	cases := []struct {
		name  string
		pkt   []byte
		steer bool
		tos   byte // the TOS the packet leaves with
	}{
		{"SYN to a replaced listener", seg(client, ipServer, 8080, tctest.SYN), true, steered},
		// ECN and the DSCP's other bits stay.
		{"SYN with ECN and a DSCP", segTOS(0xa2, client, ipServer, 8080, tctest.SYN), true, 0xa2 | steered},
		{"data of a connection accepted from one", seg(conn, ipServer, 8081, tctest.ACK), true, steered},
		{"FIN of that connection", seg(conn, ipServer, 8081, tctest.FIN|tctest.ACK), true, steered},
		// A container's own client may use the listener's port: the
		// replies to it are the container's.
		{"SYN-ACK to a replaced listener's port", seg(client, ipServer, 8080, tctest.SYN|tctest.ACK), false, 0},
		{"data to a replaced listener's port, no connection", seg(client, ipServer, 8080, tctest.ACK), false, 0},
		{"ACK with the listener's syncookie", cookieACK, true, steered},
		// The listener sent cookies: a wrong one is checked and refused.
		{"ACK without the listener's syncookie", seg(cookieClient, ipServer, 8085, tctest.ACK), false, 0},
		{"data to a port the host listens on", seg(client, ipServer, 8082, tctest.ACK), false, 0},
		{"data to a container without a replaced listener", seg(otherConn, ipOther, 8086, tctest.ACK), false, 0},
		{"SYN to a port the host listens on", seg(client, ipServer, 8082, tctest.SYN), false, 0},
		{"other port", seg(client, ipServer, 8083, tctest.SYN), false, 0},
		// Only steered packets may carry the route's TOS to a container.
		{"the route's TOS, not steered", segTOS(0x1f, client, ipServer, 8083, tctest.SYN), false, 0x1b},
		{"the route's TOS, UDP", tctest.Eth(macB, macA, 0x0800, tctest.IPv4(tctest.IPOpts{TOS: 0xfc}, tctest.ProtoUDP,
			ipClient, ipServer, tctest.UDP(40000, 53, []byte("x")))), false, 0xf8},
		{"the route's TOS to the bridge's address", segTOS(0x1c, client, gateway, 8080, tctest.SYN), false, 0x1c},
		{"another host's container", seg(client, ipClient, 8080, tctest.SYN), false, 0},
		// A container's cut-short segment is dropped (TestFromContainerTCP);
		// from elsewhere it goes on untouched.
		{"truncated", seg(client, ipServer, 8080, tctest.SYN)[:40], false, 0},
		{"IPv6", tctest.Eth(macB, macA, 0x86dd, make([]byte, 60)), false, 0},
	}
	const redirect = 7 // TC_ACT_REDIRECT
	loMAC := make(net.HardwareAddr, 6)
	progs := []struct {
		name    string
		prog    *ebpf.Program
		dst     net.HardwareAddr // the frame's new destination when steered
		verdict uint32           // when steered
		mark    uint32           // steered packets' mark: for the policy, or for no second conntrack pass
	}{
		{"from_overlay", l.objs.SksFromOverlay, macB, 0, Mark}, // TC_ACT_OK: the route takes it
		{"from_container", l.objs.SksFromContainer, loMAC, redirect, Mark},
		// The host's own packets and forwarded ones alike (a DNAT on the
		// way made their destination).
		{"to_container", l.objs.SksToContainer, loMAC, redirect, TrackedMark},
	}
	ns, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	before, _ := l.Stats()
	// Without sks_lookup on the namespace, the connection lookup ends in
	// listeners (the host's on 0.0.0.0:8082 too); with it, as on a host,
	// the lookup asks sks_lookup, which must neither refuse the segments
	// nor count them (overlay_refused is the stack's deliveries).
	for _, attached := range []bool{false, true} {
		if attached {
			lk, err := link.AttachNetNs(int(ns.Fd()), l.objs.SksLookup)
			if err != nil {
				t.Fatal(err)
			}
			defer lk.Close()
		}
		// No subtests: they would run on other threads, outside the namespace.
		for _, p := range progs {
			for _, c := range cases {
				name := fmt.Sprintf("%s (sks_lookup attached: %v): %s", p.name, attached, c.name)
				verdict, out, skb := tctest.RunSkb(t, p.prog, c.pkt, nil)
				want, wantVerdict := append([]byte{}, c.pkt...), next
				if c.steer {
					copy(want, p.dst)
					wantVerdict = p.verdict
				}
				if c.name == "truncated" && p.name == "from_container" {
					wantVerdict = 2 // TC_ACT_SHOT
				}
				if len(want) >= 34 && want[12] == 0x08 {
					withTOS(want[14:34], c.tos)
				}
				if verdict != wantVerdict {
					t.Errorf("%s: verdict %d, want %d", name, verdict, wantVerdict)
				}
				if !bytes.Equal(out[:len(want)], want) {
					t.Errorf("%s: packet\n%x\nwant\n%x", name, out[:len(want)], want)
				}
				if wantMark := map[bool]uint32{true: p.mark}[c.steer]; skb.Mark != wantMark {
					t.Errorf("%s: mark %#x, want %#x", name, skb.Mark, wantMark)
				}
			}
		}
	}
	after, _ := l.Stats()
	if after["syncookie_steered"] != before["syncookie_steered"]+2*uint64(len(progs)) {
		t.Errorf("syncookie_steered %d → %d", before["syncookie_steered"], after["syncookie_steered"])
	}
	if after["overlay_refused"] != before["overlay_refused"] {
		t.Errorf("overlay_refused %d → %d: the steering programs' lookups were counted", before["overlay_refused"], after["overlay_refused"])
	}
}

// syncookieACK has the listener at server answer a SYN from client with a
// syncookie (tcp_syncookies 2: always) and returns the frame of the ACK that
// completes that handshake. The SYN goes out of a raw socket, and the
// SYN-ACK comes back on one: client has no socket, so nothing else answers.
func syncookieACK(t *testing.T, client, server netip.AddrPort) []byte {
	t.Helper()
	if err := os.WriteFile("/proc/sys/net/ipv4/tcp_syncookies", []byte("2"), 0o644); err != nil {
		t.Fatal(err)
	}
	rx, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rx)
	if err := unix.SetsockoptTimeval(rx, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 2}); err != nil {
		t.Fatal(err)
	}
	tx, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(tx)
	segment := func(flags byte, seq, ack uint32) []byte {
		tcp := tctest.TCPWithOptions(client.Port(), server.Port(), flags, []byte{2, 4, 0x05, 0xb4}, nil) // MSS 1460
		binary.BigEndian.PutUint32(tcp[4:], seq)
		binary.BigEndian.PutUint32(tcp[8:], ack)
		pseudo := append(append(client.Addr().AsSlice(), server.Addr().AsSlice()...), 0, tctest.ProtoTCP, 0, byte(len(tcp)))
		binary.BigEndian.PutUint16(tcp[16:], tctest.Csum(append(pseudo, tcp...)))
		return tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, client.Addr(), server.Addr(), tcp)
	}
	const isn = 1000
	if err := unix.Sendto(tx, segment(tctest.SYN, isn, 0), 0, &unix.SockaddrInet4{Addr: server.Addr().As4()}); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1500)
	for {
		n, _, err := unix.Recvfrom(rx, buf, 0)
		if err != nil {
			t.Fatalf("no SYN-ACK from %s: %v", server, err)
		}
		p := buf[:n]
		if n < 40 || netip.AddrFrom4([4]byte(p[12:16])) != server.Addr() {
			continue
		}
		tcp := p[(p[0]&0xf)*4:]
		if binary.BigEndian.Uint16(tcp[0:]) != server.Port() || binary.BigEndian.Uint16(tcp[2:]) != client.Port() ||
			tcp[13] != tctest.SYN|tctest.ACK {
			continue
		}
		cookie := binary.BigEndian.Uint32(tcp[4:])
		return tctest.Eth(macB, macA, 0x0800, segment(tctest.ACK, isn+1, cookie+1))
	}
}

// withTOS sets the TOS of an IPv4 header and recomputes its checksum.
func withTOS(h []byte, tos byte) {
	h[1] = tos
	h[10], h[11] = 0, 0
	binary.BigEndian.PutUint16(h[10:], tctest.Csum(h))
}

// connection opens a TCP connection from client to server over lo and
// returns the client's address and port.
func connection(t *testing.T, server netip.AddrPort, client netip.Addr) netip.AddrPort {
	t.Helper()
	listenOn(t, server)
	c := tcpSocket(t)
	if err := unix.Bind(c, &unix.SockaddrInet4{Addr: client.As4()}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Connect(c, &unix.SockaddrInet4{Addr: server.Addr().As4(), Port: int(server.Port())}); err != nil {
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(c)
	if err != nil {
		t.Fatal(err)
	}
	return netip.AddrPortFrom(client, uint16(sa.(*unix.SockaddrInet4).Port))
}

// ownNetns moves the test's thread into a network namespace of its own,
// with lo up and holding addrs; the thread is discarded at the end.
func ownNetns(t *testing.T, addrs ...netip.Addr) {
	t.Helper()
	runtime.LockOSThread() // never unlocked: the thread ends with the test
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		t.Fatal(err)
	}
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: netlink.NewIPNet(net.IP(a.AsSlice()))}); err != nil {
			t.Fatal(err)
		}
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
}
