package overlay

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/tc/tctest"
)

func testSourceCheck(t *testing.T) *sourceCheck {
	t.Helper()
	s, err := loadSourceCheck(bpffstest.Dir(t), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.objs.Close() })
	return s
}

var (
	srcMAC   = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0c} // the container's
	nbrMAC   = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0d} // a neighbour's
	gwMAC    = net.HardwareAddr{0x0e, 0x5e, 10, 99, 0, 1}
	srcIP    = netip.MustParseAddr("10.244.1.5")
	nbrIP    = netip.MustParseAddr("10.244.1.6")
	gwIP     = netip.MustParseAddr("10.244.1.1")
	remoteIP = netip.MustParseAddr("10.244.2.7")
)

const (
	tcUnspec = 0xffffffff // TC_ACT_UNSPEC (-1): on to the next filter
	tcShot   = 2
)

func udpFrom(mac net.HardwareAddr, ip netip.Addr) []byte {
	return tctest.Eth(gwMAC, mac, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, ip, remoteIP, tctest.UDP(40000, 7000, []byte("x"))))
}

// arp builds an ARP packet (op 1 request, 2 reply) with Ethernet source
// eth, sender sha/spa, asking for or answering tpa.
func arp(eth net.HardwareAddr, op uint16, sha net.HardwareAddr, spa, tpa netip.Addr) []byte {
	b := binary.BigEndian.AppendUint16(nil, 1)
	b = binary.BigEndian.AppendUint16(b, 0x0800)
	b = append(b, 6, 4)
	b = binary.BigEndian.AppendUint16(b, op)
	s, t := spa.As4(), tpa.As4()
	b = append(append(append(append(b, sha...), s[:]...), make([]byte, 6)...), t[:]...)
	return tctest.Eth(net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, eth, 0x0806, b)
}

func TestSourceReasonsMatchProgram(t *testing.T) {
	if names := tctest.EnumNames(t, "source.h", "skv_reason", "SKV_"); !slices.Equal(names, SourceReasons()) {
		t.Fatalf("source.h: %v\nSourceReasons: %v", names, SourceReasons())
	}
}

// TestSourceCheckPackets: golden packets through skv_from_container on a
// veth (ifindex 1, BPF_PROG_RUN's loopback) whose container is srcIP,
// srcMAC. What passes goes on to the next program unchanged; everything else
// is dropped and counted under its reason.
func TestSourceCheckPackets(t *testing.T) {
	s := testSourceCheck(t)
	if int(s.objs.SkvDrops.MaxEntries()) != len(SourceReasons()) {
		t.Fatalf("%d counters, %d names", s.objs.SkvDrops.MaxEntries(), len(SourceReasons()))
	}
	if err := s.objs.SkvSources.Put(uint32(1), sourceEntry(srcIP, srcMAC)); err != nil {
		t.Fatal(err)
	}
	badARP := func(f func(b []byte)) []byte {
		b := arp(srcMAC, 1, srcMAC, srcIP, gwIP)
		f(b[14:])
		return b
	}
	ipv6 := tctest.Eth(gwMAC, srcMAC, 0x86dd, make([]byte, 48))
	vlan := tctest.Eth(gwMAC, srcMAC, 0x8100, append([]byte{0, 5, 0x08, 0}, udpFrom(srcMAC, srcIP)[14:]...))
	for _, tc := range []struct {
		name   string
		in     []byte
		reason string // "": passed on
	}{
		{"own UDP", udpFrom(srcMAC, srcIP), ""},
		{"own TCP", tctest.Eth(gwMAC, srcMAC, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, srcIP, remoteIP, tctest.TCP(40000, 80, tctest.SYN, nil))), ""},
		{"own header only", udpFrom(srcMAC, srcIP)[:14+20], ""},
		{"neighbour's source", udpFrom(srcMAC, nbrIP), "ip_source"},
		{"another host's container", udpFrom(srcMAC, remoteIP), "ip_source"},
		{"the gateway's", udpFrom(srcMAC, gwIP), "ip_source"},
		{"outside address", udpFrom(srcMAC, netip.MustParseAddr("192.0.2.9")), "ip_source"},
		{"unspecified", udpFrom(srcMAC, netip.IPv4Unspecified()), "ip_source"},
		{"neighbour's MAC", udpFrom(nbrMAC, srcIP), "mac_source"},
		{"ARP request", arp(srcMAC, 1, srcMAC, srcIP, gwIP), ""},
		{"ARP reply", arp(srcMAC, 2, srcMAC, srcIP, gwIP), ""},
		{"gratuitous ARP", arp(srcMAC, 1, srcMAC, srcIP, srcIP), ""},
		{"ARP claiming the neighbour", arp(srcMAC, 1, srcMAC, nbrIP, gwIP), "arp_sender"},
		{"ARP reply claiming the gateway", arp(srcMAC, 2, srcMAC, gwIP, nbrIP), "arp_sender"},
		{"ARP probe of its own address (RFC 5227)", arp(srcMAC, 1, srcMAC, netip.IPv4Unspecified(), srcIP), ""},
		{"ARP probe of the neighbour's address", arp(srcMAC, 1, srcMAC, netip.IPv4Unspecified(), nbrIP), "arp_sender"},
		{"ARP reply from 0.0.0.0", arp(srcMAC, 2, srcMAC, netip.IPv4Unspecified(), srcIP), "arp_sender"},
		{"ARP probe with the neighbour's hardware address", arp(srcMAC, 1, nbrMAC, netip.IPv4Unspecified(), srcIP), "arp_sender"},
		{"ARP with the neighbour's hardware address", arp(srcMAC, 2, nbrMAC, srcIP, gwIP), "arp_sender"},
		{"ARP from the neighbour's MAC", arp(nbrMAC, 1, nbrMAC, srcIP, gwIP), "mac_source"},
		{"ARP not Ethernet", badARP(func(b []byte) { b[1] = 6 }), "malformed"},
		{"ARP not IPv4", badARP(func(b []byte) { b[2], b[3] = 0x86, 0xdd }), "malformed"},
		{"ARP hardware length 8", badARP(func(b []byte) { b[4] = 8 }), "malformed"},
		{"ARP protocol length 16", badARP(func(b []byte) { b[5] = 16 }), "malformed"},
		{"ARP truncated", arp(srcMAC, 1, srcMAC, srcIP, gwIP)[:14+27], "malformed"},
		// (BPF_PROG_RUN refuses an IPv4 frame shorter than its header;
		// the same head() serves both protocols.)
		{"IPv6", ipv6, "other_protocol"},
		// In the kernel a tag is taken off before tc (vlan_present:
		// "vlan"); BPF_PROG_RUN leaves it in the frame.
		{"802.1Q tagged", vlan, "other_protocol"},
		{"802.3 length field", tctest.Eth(gwMAC, srcMAC, 64, make([]byte, 64)), "other_protocol"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := drops(t, s)
			ret, out := tctest.Run(t, s.objs.SkvFromContainer, tc.in)
			d := dropsSince(t, s, before)
			if tc.reason == "" {
				if ret != tcUnspec || len(d) != 0 {
					t.Errorf("verdict %#x, counted %v; want TCX_NEXT, nothing", ret, d)
				}
				if !bytes.Equal(out[:len(tc.in)], tc.in) {
					t.Error("packet changed")
				}
				return
			}
			if ret != tcShot || len(d) != 1 || d[tc.reason] != 1 {
				t.Errorf("verdict %#x, counted %v; want TC_ACT_SHOT, %s", ret, d, tc.reason)
			}
		})
	}
	// Fail closed: a veth with the program and no entry passes nothing.
	if err := s.objs.SkvSources.Delete(uint32(1)); err != nil {
		t.Fatal(err)
	}
	before := drops(t, s)
	if ret, _ := tctest.Run(t, s.objs.SkvFromContainer, udpFrom(srcMAC, srcIP)); ret != tcShot {
		t.Errorf("no entry: verdict %#x, want TC_ACT_SHOT", ret)
	}
	if d := dropsSince(t, s, before); d["no_entry"] != 1 {
		t.Errorf("no entry: counted %v", d)
	}
}

func drops(t *testing.T, s *sourceCheck) map[string]uint64 {
	t.Helper()
	d, err := (&Overlay{src: s}).SourceDrops()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func dropsSince(t *testing.T, s *sourceCheck, before map[string]uint64) map[string]uint64 {
	t.Helper()
	d := map[string]uint64{}
	for k, v := range drops(t, s) {
		if v != before[k] {
			d[k] = v - before[k]
		}
	}
	return d
}

// TestSourceCheckAttach: the check goes on a veth once however often it is
// asserted, follows a re-created veth, is reported by check, and goes with
// SyncSources (an endpoint no longer listed) and unguard.
func TestSourceCheckAttach(t *testing.T) {
	inTestNetns(t, func() {
		s := testSourceCheck(t)
		o := &Overlay{src: s}
		mkVeth := func(name string) netlink.Link {
			t.Helper()
			if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}); err != nil {
				t.Fatal(err)
			}
			l, err := netlink.LinkByName(name)
			if err != nil {
				t.Fatal(err)
			}
			return l
		}
		programs := func(l netlink.Link) int {
			t.Helper()
			filters, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
			if err != nil && !errors.Is(err, unix.EINVAL) { // EINVAL: no clsact
				t.Fatal(err)
			}
			n := 0
			for _, f := range filters {
				if bf, ok := f.(*netlink.BpfFilter); ok && bf.Name == sourceFilter {
					n++
				}
			}
			return n
		}
		e := cluster.Endpoint{ContainerID: "c1", IfName: "eth0", Veth: VethName("c1", "eth0"), IP: netip.PrefixFrom(srcIP, 24), MAC: srcMAC.String()}
		veth := mkVeth(e.Veth)
		if err := s.check(veth, srcIP); err == nil {
			t.Error("check passes an unguarded veth")
		}
		for range 2 {
			if err := s.guard(veth, srcIP, srcMAC); err != nil {
				t.Fatal(err)
			}
		}
		if n := programs(veth); n != 1 {
			t.Errorf("%d programs on the veth after two guards, want 1", n)
		}
		if err := s.check(veth, srcIP); err != nil {
			t.Error(err)
		}
		if err := s.check(veth, nbrIP); err == nil {
			t.Error("check passes a veth guarded for another address")
		}
		// The veth is re-created (a new ifindex): reconciling attaches the
		// check to the new one and drops the old entry.
		netlink.LinkDel(veth)
		veth = mkVeth(e.Veth)
		if err := o.SyncSources([]cluster.Endpoint{e}); err != nil {
			t.Fatal(err)
		}
		if err := s.check(veth, srcIP); err != nil {
			t.Error(err)
		}
		var v skvSource
		if err := s.objs.SkvSources.Lookup(uint32(veth.Attrs().Index), &v); err != nil || v != sourceEntry(srcIP, srcMAC) {
			t.Errorf("entry %+v, %v", v, err)
		}
		if n := entries(t, s); n != 1 {
			t.Errorf("%d entries, want the new veth's", n)
		}
		// An entry there keeps its MAC (read from the interface at add)
		// over the store's.
		e2 := e
		e2.MAC = nbrMAC.String()
		if err := o.SyncSources([]cluster.Endpoint{e2}); err != nil {
			t.Fatal(err)
		}
		if s.objs.SkvSources.Lookup(uint32(veth.Attrs().Index), &v); v != sourceEntry(srcIP, srcMAC) {
			t.Errorf("entry %+v after a sync with another MAC", v)
		}
		// No endpoint: entry and link go, the veth has no program.
		if err := o.SyncSources(nil); err != nil {
			t.Fatal(err)
		}
		if n := entries(t, s); n != 0 || programs(veth) != 0 {
			t.Errorf("%d entries, %d programs after the endpoint went", n, programs(veth))
		}
		// unguard after a guard removes both too.
		if err := s.guard(veth, srcIP, srcMAC); err != nil {
			t.Fatal(err)
		}
		if err := s.unguard(uint32(veth.Attrs().Index)); err != nil {
			t.Fatal(err)
		}
		if n := entries(t, s); n != 0 || programs(veth) != 0 {
			t.Errorf("%d entries, %d programs after unguard", n, programs(veth))
		}
		if err := s.guard(veth, srcIP, nil); err == nil {
			t.Error("guard accepts a missing MAC")
		}
	})
}

func entries(t *testing.T, s *sourceCheck) int {
	t.Helper()
	n := 0
	var k uint32
	var v skvSource
	it := s.objs.SkvSources.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// BenchmarkSourceCheck times skv_from_container (BPF_PROG_RUN, hot caches)
// on what every container packet costs: one that passes.
func BenchmarkSourceCheck(b *testing.B) {
	dir := bpffstest.Dir(b)
	s, err := loadSourceCheck(dir, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		b.Fatal(err)
	}
	defer s.objs.Close()
	if err := s.objs.SkvSources.Put(uint32(1), sourceEntry(srcIP, srcMAC)); err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		pkt  []byte
	}{
		{"own UDP", udpFrom(srcMAC, srcIP)},
		{"own TCP 1400 bytes", tctest.Eth(gwMAC, srcMAC, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, srcIP, remoteIP, tctest.TCP(40000, 80, tctest.ACK, make([]byte, 1400))))},
	} {
		b.Run(c.name, func(b *testing.B) {
			ret, per, err := s.objs.SkvFromContainer.Benchmark(c.pkt, b.N, nil)
			if err != nil || ret != tcUnspec {
				b.Fatalf("ret %d: %v", ret, err)
			}
			b.ReportMetric(float64(per.Nanoseconds()), "ns/run")
		})
	}
}
