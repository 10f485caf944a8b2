package sockets

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"runtime"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/tc/tctest"
)

// Golden-packet tests (BPF_PROG_RUN) of the tc and sk_lookup programs.

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
func withPeer(t *testing.T, l *Layer) {
	t.Helper()
	hosts := []cluster.Host{testHost, {Name: "h2", UnderlayIP: ulPeer, Subnet: subnetB}}
	if err := l.Sync(hosts, nil, nil, nil); err != nil {
		t.Fatal(err)
	}
}

func pendingEntry(t *testing.T, l *Layer, saddr, daddr netip.Addr) (sksSksPending, bool) {
	t.Helper()
	k := sksSksTuple{Saddr: ip32(saddr), Daddr: ip32(daddr), Sport: port16(40000), Dport: port16(8080)}
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
	const next = ^uint32(0) // TC_ACT_UNSPEC: the next program on the device decides
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
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			l.objs.SksSyns.Delete(sksSksTuple{Saddr: ip32(ulPeer), Daddr: ip32(testHost.UnderlayIP), Sport: port16(40000), Dport: port16(8080)})
			before, _ := l.Stats()
			verdict, out := tctest.Run(t, l.objs.SksFromUnderlay, c.pkt)
			if verdict != c.verdict {
				t.Fatalf("verdict %d, want %d", verdict, c.verdict)
			}
			if !bytes.Equal(out[:len(c.pkt)], c.pkt) {
				t.Fatal("packet changed")
			}
			p, ok := pendingEntry(t, l, ulPeer, testHost.UnderlayIP)
			if ok != c.record {
				t.Fatalf("recorded=%v, want %v", ok, c.record)
			}
			if ok && (p.DstIp != ip32(ipServer) || p.SrcIp != ip32(ipClient) || p.DstPort != port16(8080)) {
				t.Fatalf("recorded %+v", p)
			}
			after, _ := l.Stats()
			if c.reason != "" && after[c.reason] != before[c.reason]+1 {
				t.Fatalf("counter %s %d → %d", c.reason, before[c.reason], after[c.reason])
			}
		})
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

func publish(t *testing.T, l *Layer, fd int, at netip.AddrPort) {
	t.Helper()
	if err := l.objs.SksListen.Put(sksSksKey{Ip: ip32(at.Addr()), Port: port16(at.Port())}, uint64(fd)); err != nil {
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

func lookup(t *testing.T, l *Layer, from, to netip.AddrPort) uint64 {
	t.Helper()
	in := skLookup{Family: syscall.AF_INET, Protocol: syscall.IPPROTO_TCP, RemoteIP4: from.Addr().As4(),
		RemotePort: port16(from.Port()), LocalIP4: to.Addr().As4(), LocalPort: uint32(to.Port())}
	var out skLookup
	ret, err := l.objs.SksLookup.Run(&ebpf.RunOptions{Context: in, ContextOut: &out})
	if err != nil {
		t.Fatal(err)
	}
	if ret != 1 {
		t.Fatalf("sk_lookup returned %d, want SK_PASS", ret)
	}
	return out.Cookie
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
	// A recorded option SYN without its listener: the kernel answers.
	pkt := syn(ulPeer, testHost.UnderlayIP, tctest.SYN, append(append([]byte{}, linuxSYNOptions...), synOption(server, ipClient)...))
	tctest.Run(t, l.objs.SksFromUnderlay, pkt)
	if got := lookup(t, l, client, host); got != 0 {
		t.Fatalf("assigned to %d without a listener", got)
	}
	publish(t, l, ln, server)
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
	if got := lookup(t, l, netip.AddrPortFrom(ipClient, 40000), netip.AddrPortFrom(ipServer, 8081)); got != 0 {
		t.Fatalf("other port assigned to %d", got)
	}
}

// TestToHostStack runs in a network namespace of its own, so that it can
// hold real connections and a host listener for the programs' socket
// lookups to find: the test's thread enters it and is discarded at the end.
func TestToHostStack(t *testing.T) {
	l := loadTest(t)
	runtime.LockOSThread() // never unlocked: the thread ends with the test
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		t.Fatal(err)
	}
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []netip.Addr{ipServer, ipClient} {
		if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: netlink.NewIPNet(net.IP(a.AsSlice()))}); err != nil {
			t.Fatal(err)
		}
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	ln, _ := listener(t)
	publish(t, l, ln, netip.AddrPortFrom(ipServer, 8080))
	// A connection accepted from a replaced listener (its local address is
	// the container's), and a host listener on every address, port 8082.
	conn := connection(t, netip.AddrPortFrom(ipServer, 8081), ipClient)
	listenOn(t, netip.AddrPortFrom(netip.IPv4Unspecified(), 8082))

	bridge := overlay.BridgeMAC(testHost.UnderlayIP)
	seg := func(src netip.AddrPort, dst netip.Addr, port uint16, flags byte) []byte {
		return tctest.Eth(macB, macA, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, src.Addr(), dst,
			tctest.TCP(src.Port(), port, flags, []byte("x"))))
	}
	client := netip.AddrPortFrom(ipClient, 40000)
	cases := []struct {
		name  string
		pkt   []byte
		steer bool
	}{
		{"SYN to a replaced listener", seg(client, ipServer, 8080, tctest.SYN), true},
		{"data of a connection accepted from one", seg(conn, ipServer, 8081, tctest.ACK), true},
		{"FIN of that connection", seg(conn, ipServer, 8081, tctest.FIN|tctest.ACK), true},
		// A container's own client may use the listener's port: the
		// replies to it are the container's.
		{"SYN-ACK to a replaced listener's port", seg(client, ipServer, 8080, tctest.SYN|tctest.ACK), false},
		{"data to a replaced listener's port, no connection", seg(client, ipServer, 8080, tctest.ACK), false},
		{"data to a port the host listens on", seg(client, ipServer, 8082, tctest.ACK), false},
		{"SYN to a port the host listens on", seg(client, ipServer, 8082, tctest.SYN), false},
		{"other port", seg(client, ipServer, 8083, tctest.SYN), false},
		{"another host's container", seg(client, ipClient, 8080, tctest.SYN), false},
		{"truncated", seg(client, ipServer, 8080, tctest.SYN)[:40], false},
		{"IPv6", tctest.Eth(macB, macA, 0x86dd, make([]byte, 60)), false},
	}
	const redirect = 7 // TC_ACT_REDIRECT
	progs := []struct {
		name    string
		prog    *ebpf.Program
		dst     net.HardwareAddr // the frame's new destination when steered
		verdict uint32           // when steered
	}{
		{"from_overlay", l.objs.SksFromOverlay, macB, 0},
		{"from_container", l.objs.SksFromContainer, bridge, 0},
		// Test runs give the packet a socket, as the host's own packets have.
		{"from_host", l.objs.SksFromHost, make(net.HardwareAddr, 6), redirect},
	}
	// No subtests: they would run on other threads, outside the namespace.
	for _, p := range progs {
		for _, c := range cases {
			name := p.name + ": " + c.name
			verdict, out, skb := tctest.RunSkb(t, p.prog, c.pkt, nil)
			want, wantVerdict := append([]byte{}, c.pkt...), uint32(0)
			if c.steer {
				copy(want, p.dst)
				wantVerdict = p.verdict
			}
			if verdict != wantVerdict {
				t.Errorf("%s: verdict %d, want %d", name, verdict, wantVerdict)
			}
			if !bytes.Equal(out[:len(want)], want) {
				t.Errorf("%s: packet\n%x\nwant\n%x", name, out[:len(want)], want)
			}
			if steered := skb.Mark == Mark; steered != c.steer {
				t.Errorf("%s: mark %#x, steered=%v want %v", name, skb.Mark, steered, c.steer)
			}
		}
	}
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
