package cache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/tc/tctest"
)

const (
	testVNI     = 42
	tcNext      = ^uint32(0) // TC_ACT_UNSPEC: on to the device's next filter
	tcActShot   = 2
	tcActRedir  = 7
	portMinTest = 10000
)

// newTestCache loads the programs as host "h1" (underlay 10.99.0.1, subnet
// 10.244.1.0/24) into a private bpffs directory, without attaching them.
func newTestCache(t testing.TB, capacity Capacity) *fastPath {
	t.Helper()
	return loadTestCache(t, capacity, TunnelVXLAN)
}

func loadTestCache(t testing.TB, capacity Capacity, tunnel string) *fastPath {
	t.Helper()
	dir := bpffstest.Dir(t)
	under := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Name: "ul0", Index: 1, HardwareAddr: macUnderlay, MTU: 1500}}
	c, err := loadOn(config{
		Cluster: cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: testVNI, VXLANPort: 4789},
		Host: cluster.Host{Name: "h1", UnderlayIP: ulLocal, Subnet: netip.MustParsePrefix("10.244.1.0/24"),
			VTEPMAC: macVTEP.String()},
		PinDir:   dir,
		Capacity: capacity,
		Tunnel:   tunnel,
	}, under, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// delta runs f and returns how the counters changed.
func delta(t *testing.T, c *fastPath, f func()) map[string]uint64 {
	t.Helper()
	before, err := c.Stats()
	if err != nil {
		t.Fatal(err)
	}
	f()
	after, _ := c.Stats()
	d := map[string]uint64{}
	for k, v := range after {
		if v != before[k] {
			d[k] = v - before[k]
		}
	}
	return d
}

func expectCount(t *testing.T, d map[string]uint64, reasons ...string) {
	t.Helper()
	ok := len(d) == len(reasons)
	for _, r := range reasons {
		ok = ok && d[r] == 1
	}
	if !ok {
		t.Errorf("counters moved %v, want only %v +1", d, reasons)
	}
}

// ipAt checks the IPv4 header at off and returns its TOS and TTL.
func ipAt(t *testing.T, pkt []byte, off int) (tos, ttl byte) {
	t.Helper()
	if len(pkt) < off+20 {
		t.Fatalf("packet of %d bytes has no IPv4 header at %d", len(pkt), off)
	}
	h := pkt[off : off+int(pkt[off]&0xf)*4]
	if tctest.Csum(h) != 0 {
		t.Errorf("IPv4 header checksum at %d is wrong: % x", off, h)
	}
	return h[1], h[8]
}

// fill puts entries into the caches so that the TCP flow of egressTCP /
// ingressTCP hits on both paths.
func fill(t *testing.T, c *fastPath, filter, egressIP, egressHost, ingress bool) {
	t.Helper()
	k := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40000), Rport: ntohs(80), Proto: tctest.ProtoTCP}
	put := func(m *ebpf.Map, key, val any) {
		if err := m.Put(key, val); err != nil {
			t.Fatal(err)
		}
	}
	if filter {
		put(c.objs.SkcFilter, k, skcFilterVal{Egress: 1, Ingress: 1})
	}
	if egressIP {
		put(c.objs.SkcEgressIp, be32(ipRemote), be32(ulPeer))
	}
	if egressHost {
		var eh skcEgressHost
		copy(eh.Hdr[:], encapsulatedTCP(tctest.IPOpts{})[:64])
		eh.Ifindex = 7
		put(c.objs.SkcEgressHost, be32(ulPeer), eh)
	}
	if ingress {
		var ep skcIngressEp
		ep.Ifindex = 9
		copy(ep.MacDst[:], macContainer)
		copy(ep.MacSrc[:], macBridge)
		ep.Ready = 1
		put(c.objs.SkcIngress, be32(ipLocal), ep)
	}
}

func TestReasonsMatchProgram(t *testing.T) {
	spec, err := loadSkc()
	if err != nil {
		t.Fatal(err)
	}
	if n := spec.Maps["skc_stats"].MaxEntries; int(n) != len(Reasons) {
		t.Fatalf("cache.h has %d reasons, stats.go names %d", n, len(Reasons))
	}
	seen := map[string]bool{}
	for i, r := range Reasons {
		if r.Program == "" || r.Outcome == "" || r.Name != r.Program+"/"+r.Outcome {
			t.Errorf("reason %d of enum reason has no name in stats.go: %+v", i, r)
		}
		if seen[r.Name] {
			t.Errorf("reason %d: %s named twice", i, r.Name)
		}
		seen[r.Name] = true
	}
}

func TestFromContainerPassesUntouched(t *testing.T) {
	c := newTestCache(t, Capacity{})
	fill(t, c, true, true, true, true) // even with warm caches
	ipv6 := tctest.Eth(macBridge, macContainer, 0x86dd, make([]byte, 60))
	arp := tctest.Eth(macBridge, macContainer, 0x0806, make([]byte, 28))
	for _, tc := range []struct {
		name, reason string
		pkt          []byte
	}{
		{"IPv6", "from_container/pass_not_ipv4", ipv6},
		{"ARP", "from_container/pass_not_ipv4", arp},
		{"IPv4 header only", "from_container/pass_unsupported", egressTCP(tctest.IPOpts{}, tctest.ACK)[:14+20]},
		{"truncated TCP", "from_container/pass_unsupported", egressTCP(tctest.IPOpts{}, tctest.ACK)[:14+20+10]},
		{"IP options", "from_container/pass_unsupported", tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{Options: []byte{1, 1, 1, 0}}, tctest.ProtoTCP, ipLocal, ipRemote, tctest.TCP(40000, 80, tctest.ACK, payload)))},
		{"first fragment", "from_container/pass_unsupported", egressTCP(tctest.IPOpts{Frag: 0x2000}, tctest.ACK)},
		{"later fragment", "from_container/pass_unsupported", egressTCP(tctest.IPOpts{Frag: 0x0010}, tctest.ACK)},
		{"SCTP", "from_container/pass_unsupported", tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, 132, ipLocal, ipRemote, payload))},
		{"ICMP unreachable", "from_container/pass_unsupported", tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoICMP, ipLocal, ipRemote, tctest.ICMP(3, payload)))},
		{"same host, not in the table", "from_container/local_pass", tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, ipLocal, ipLocal2, tctest.TCP(40000, 80, tctest.ACK, payload)))},
		{"to the host's underlay", "from_container/pass_not_remote", tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, ipLocal, ulPeer, tctest.TCP(40000, 80, tctest.ACK, payload)))},
		{"outside the cluster", "from_container/pass_not_remote", tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, ipLocal, netip.MustParseAddr("192.0.2.1"), tctest.UDP(5000, 53, payload)))},
		{"SYN-ACK", "from_container/pass_syn_fin_rst", egressTCP(tctest.IPOpts{}, tctest.SYN|tctest.ACK)},
		{"FIN", "from_container/pass_syn_fin_rst", egressTCP(tctest.IPOpts{}, tctest.FIN|tctest.ACK)},
		{"RST", "from_container/pass_syn_fin_rst", egressTCP(tctest.IPOpts{}, tctest.RST)},
		{"TTL 1", "from_container/pass_ttl", egressTCP(tctest.IPOpts{TTL: 1}, tctest.ACK)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ret uint32
			var out []byte
			d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromContainer, tc.pkt) })
			if ret != tcNext || !bytes.Equal(out, tc.pkt) {
				t.Errorf("ret %d, packet changed: %v", ret, !bytes.Equal(out, tc.pkt))
			}
			expectCount(t, d, tc.reason)
		})
	}
}

// TestSYNForgetsFlow: a SYN starts a flow anew, in either direction: the
// filter's entry for its 4-tuple goes (counted besides the pass), so a
// connection that reuses the 4-tuple of one the caches held — one that may
// take a path they never learn, such as a host socket's — is not put on
// the fast path until the overlay lets it through again. A SYN-ACK leaves
// the entry, and so does a SYN from an underlay host the inner source does
// not live on.
func TestSYNForgetsFlow(t *testing.T) {
	key := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40000), Rport: ntohs(80), Proto: tctest.ProtoTCP}
	for _, tc := range []struct {
		name    string
		prog    func(c *fastPath) *ebpf.Program
		pkt     []byte
		reasons []string
		forgets bool
	}{
		{"from_container SYN", func(c *fastPath) *ebpf.Program { return c.objs.FromContainer }, egressTCP(tctest.IPOpts{}, tctest.SYN),
			[]string{"from_container/new_unjudged", "from_container/syn_flow_forgotten"}, true},
		{"from_underlay SYN", func(c *fastPath) *ebpf.Program { return c.objs.FromUnderlay }, ingressTCP(tctest.IPOpts{}, tctest.SYN),
			[]string{"from_underlay/new_unjudged", "from_underlay/syn_flow_forgotten"}, true},
		{"from_container SYN-ACK", func(c *fastPath) *ebpf.Program { return c.objs.FromContainer }, egressTCP(tctest.IPOpts{}, tctest.SYN|tctest.ACK),
			[]string{"from_container/pass_syn_fin_rst"}, false},
		// A SYN in VXLAN from another host than the one this host sends
		// the inner source to is forged (or stale): the flow stays.
		{"from_underlay SYN from another host", func(c *fastPath) *ebpf.Program { return c.objs.FromUnderlay }, forgedIngressSYN(),
			[]string{"from_underlay/pass_syn_fin_rst"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			fill(t, c, true, true, true, true)
			var ret uint32
			var out []byte
			d := delta(t, c, func() { ret, out = tctest.Run(t, tc.prog(c), tc.pkt) })
			if ret != tcNext || !bytes.Equal(out, tc.pkt) {
				t.Errorf("ret %d, packet changed: %v", ret, !bytes.Equal(out, tc.pkt))
			}
			want := map[string]uint64{}
			for _, r := range tc.reasons {
				want[r] = 1
			}
			if !maps.Equal(d, want) {
				t.Errorf("counters moved %v, want %v", d, want)
			}
			var f skcFilterVal
			err := c.objs.SkcFilter.Lookup(key, &f)
			if forgot := errors.Is(err, ebpf.ErrKeyNotExist); forgot != tc.forgets {
				t.Errorf("filter entry forgotten: %v (lookup: %v), want %v", forgot, err, tc.forgets)
			}
			if !tc.forgets {
				return
			}
			// The flow's next segment misses: the overlay carries it.
			d = delta(t, c, func() { ret, _ = tctest.Run(t, c.objs.FromContainer, egressTCP(tctest.IPOpts{}, tctest.ACK)) })
			expectCount(t, d, "from_container/miss_filter")
		})
	}
}

// forgedIngressSYN is ingressTCP's SYN from another underlay host than
// the peer's.
func forgedIngressSYN() []byte {
	inner := tctest.Eth(macVTEP, macPeerVTEP, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, ipRemote, ipLocal, tctest.TCP(80, 40000, tctest.SYN, payload)))
	return tctest.VXLAN(tctest.IPOpts{}, macPeer, macUnderlay, netip.MustParseAddr("10.99.0.77"), ulLocal, testVNI, 4789, inner)
}

func TestFromContainerMisses(t *testing.T) {
	for _, tc := range []struct {
		name                                  string
		filter, egressIP, egressHost, ingress bool
		reason                                string
		marked                                bool
	}{
		{"cold", false, false, false, false, "from_container/miss_filter", true},
		{"no container-to-host entry", true, false, false, true, "from_container/miss_egress_ip", true},
		{"no headers for the host", true, true, false, true, "from_container/miss_egress_host", true},
		{"reverse check", true, true, true, false, "from_container/pass_reverse_check", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			fill(t, c, tc.filter, tc.egressIP, tc.egressHost, tc.ingress)
			in := egressTCP(tctest.IPOpts{TOS: 0x20}, tctest.ACK) // the container's own DSCP must survive
			var ret uint32
			var out []byte
			d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromContainer, in) })
			expectCount(t, d, tc.reason)
			if ret != tcNext || len(out) != len(in) {
				t.Fatalf("ret %d, len %d", ret, len(out))
			}
			tos, ttl := ipAt(t, out, 14)
			want := byte(0x20)
			if tc.marked {
				want |= markMiss
			}
			if tos != want || ttl != 64 {
				t.Errorf("TOS %#x TTL %d, want TOS %#x TTL 64", tos, ttl, want)
			}
			if !bytes.Equal(out[34:], in[34:]) {
				t.Error("payload changed")
			}
		})
	}
}

// TestFromContainerClearsForgedMarks: skiff's marks in a container's own
// packet to the cluster are cleared before anything reads them — on a miss
// (the fast path's miss mark alone goes on), on a pass, on a hit, for
// fragments too; a packet leaving the cluster keeps its DSCP.
func TestFromContainerClearsForgedMarks(t *testing.T) {
	forged := tctest.IPOpts{TOS: 0x20 | markMiss | markEst}
	outside := tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(forged, tctest.ProtoUDP, ipLocal, netip.MustParseAddr("192.0.2.1"), tctest.UDP(5000, 53, payload)))
	for _, tc := range []struct {
		name    string
		warm    bool
		pkt     []byte
		reasons []string
		tos     byte // inner TOS after
		off     int  // of the IPv4 header after
	}{
		{"miss", false, egressTCP(forged, tctest.ACK), []string{"from_container/forged_marks_cleared", "from_container/miss_filter"}, 0x20 | markMiss, 14},
		{"SYN", false, egressTCP(forged, tctest.SYN), []string{"from_container/forged_marks_cleared", "from_container/new_unjudged"}, 0x20, 14},
		{"fragment", false, egressTCP(tctest.IPOpts{TOS: forged.TOS, Frag: 0x2000}, tctest.ACK), []string{"from_container/forged_marks_cleared", "from_container/pass_unsupported"}, 0x20, 14},
		{"hit", true, egressTCP(forged, tctest.ACK), []string{"from_container/forged_marks_cleared", "from_container/hit"}, 0x20, 64},
		{"outside the cluster", false, outside, []string{"from_container/pass_not_remote"}, forged.TOS, 14},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			fill(t, c, tc.warm, tc.warm, tc.warm, tc.warm)
			var out []byte
			d := delta(t, c, func() { _, out = tctest.Run(t, c.objs.FromContainer, tc.pkt) })
			if len(d) != len(tc.reasons) {
				t.Errorf("counters moved %v, want %v", d, tc.reasons)
			}
			for _, r := range tc.reasons {
				if d[r] != 1 {
					t.Errorf("counters moved %v, want %v", d, tc.reasons)
				}
			}
			if tos, _ := ipAt(t, out, tc.off); tos != tc.tos {
				t.Errorf("TOS %#x, want %#x", tos, tc.tos)
			}
		})
	}
}

func TestFromContainerHit(t *testing.T) {
	c := newTestCache(t, Capacity{})
	fill(t, c, true, true, true, true)
	in := egressTCP(tctest.IPOpts{TOS: 0x20}, tctest.ACK|tctest.PSH)
	var ret uint32
	var out []byte
	d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromContainer, in) })
	expectCount(t, d, "from_container/hit")
	if ret != tcActRedir {
		t.Fatalf("ret %d, want redirect", ret)
	}
	if len(out) != len(in)+50 {
		t.Fatalf("encapsulated length %d, want %d", len(out), len(in)+50)
	}
	want := encapsulatedTCP(tctest.IPOpts{})
	// Outer Ethernet, VXLAN header and inner Ethernet come from the cache.
	if !bytes.Equal(out[:14], want[:14]) || !bytes.Equal(out[42:64], want[42:64]) {
		t.Errorf("cached headers not copied:\n got % x\nwant % x", out[:64], want[:64])
	}
	ipAt(t, out, 14)
	if got := binary.BigEndian.Uint16(out[16:]); int(got) != len(out)-14 {
		t.Errorf("outer total length %d, want %d", got, len(out)-14)
	}
	if out[14+8] != 64 || out[14+9] != tctest.ProtoUDP || !bytes.Equal(out[26:34], want[26:34]) {
		t.Errorf("outer TTL/protocol/addresses wrong: % x", out[14:34])
	}
	sport, dport := binary.BigEndian.Uint16(out[34:]), binary.BigEndian.Uint16(out[36:])
	if sport < portMinTest && sport < 32768 || dport != 4789 {
		t.Errorf("UDP ports %d -> %d", sport, dport)
	}
	if l := binary.BigEndian.Uint16(out[38:]); int(l) != len(out)-34 || binary.BigEndian.Uint16(out[40:]) != 0 {
		t.Errorf("UDP length %d (want %d), checksum %#x (want 0)", l, len(out)-34, binary.BigEndian.Uint16(out[40:]))
	}
	tos, ttl := ipAt(t, out, 64)
	if tos != 0x20 || ttl != 63 {
		t.Errorf("inner TOS %#x TTL %d, want 0x20 and 63 (one routed hop)", tos, ttl)
	}
	if !bytes.Equal(out[64+20:], in[14+20:]) {
		t.Error("inner transport header or payload changed")
	}
	// The same flow hashes to the same source port every time.
	_, again := tctest.Run(t, c.objs.FromContainer, in)
	if binary.BigEndian.Uint16(again[34:]) != sport {
		t.Error("UDP source port is not stable for a flow")
	}
}

func TestFromContainerICMPEchoHit(t *testing.T) {
	c := newTestCache(t, Capacity{})
	fill(t, c, false, true, true, true)
	k := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(1), Rport: ntohs(1), Proto: tctest.ProtoICMP} // the echo identifier stands for both ports
	if err := c.objs.SkcFilter.Put(k, skcFilterVal{Egress: 1, Ingress: 1}); err != nil {
		t.Fatal(err)
	}
	in := tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoICMP, ipLocal, ipRemote, tctest.ICMP(8, payload)))
	if ret, out := tctest.Run(t, c.objs.FromContainer, in); ret != tcActRedir || len(out) != len(in)+50 {
		t.Errorf("echo request: ret %d len %d", ret, len(out))
	}
}

func TestFromUnderlay(t *testing.T) {
	for _, tc := range []struct {
		name                                  string
		filter, egressIP, egressHost, ingress bool
		pkt                                   []byte
		reason                                string
		innerMarked, unchanged                bool
	}{
		{name: "not VXLAN", pkt: tctest.Eth(macUnderlay, macPeer, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, ulPeer, ulLocal, tctest.UDP(5000, 53, payload))), reason: "from_underlay/pass_not_vxlan", unchanged: true},
		{name: "IPv6 underlay", pkt: tctest.Eth(macUnderlay, macPeer, 0x86dd, make([]byte, 80)), reason: "from_underlay/pass_not_vxlan", unchanged: true},
		{name: "wrong VNI", pkt: tctest.VXLAN(tctest.IPOpts{}, macPeer, macUnderlay, ulPeer, ulLocal, testVNI+1, 4789, tctest.Eth(macVTEP, macPeerVTEP, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, ipRemote, ipLocal, tctest.TCP(80, 40000, tctest.ACK, payload)))), reason: "from_underlay/pass_not_vxlan", unchanged: true},
		{name: "inner IPv6", pkt: tctest.VXLAN(tctest.IPOpts{}, macPeer, macUnderlay, ulPeer, ulLocal, testVNI, 4789, tctest.Eth(macVTEP, macPeerVTEP, 0x86dd, make([]byte, 60))), reason: "from_underlay/pass_not_vxlan", unchanged: true},
		{name: "truncated inner", pkt: ingressTCP(tctest.IPOpts{}, tctest.ACK)[:64+10], reason: "from_underlay/pass_not_vxlan", unchanged: true},
		{name: "outer IP options", pkt: tctest.Eth(macUnderlay, macPeer, 0x0800, tctest.IPv4(tctest.IPOpts{Options: []byte{1, 1, 1, 0}}, tctest.ProtoUDP, ulPeer, ulLocal, ingressTCP(tctest.IPOpts{}, tctest.ACK)[34:])), reason: "from_underlay/pass_not_vxlan", unchanged: true},
		{name: "wrong destination MAC", pkt: tctest.VXLAN(tctest.IPOpts{}, macPeer, macPeer, ulPeer, ulLocal, testVNI, 4789, ingressTCP(tctest.IPOpts{}, tctest.ACK)[64-14:]), reason: "from_underlay/pass_not_mine", unchanged: true},
		{name: "wrong destination IP", pkt: tctest.VXLAN(tctest.IPOpts{}, macPeer, macUnderlay, ulPeer, ulOther, testVNI, 4789, ingressTCP(tctest.IPOpts{}, tctest.ACK)[64-14:]), reason: "from_underlay/pass_not_mine", unchanged: true},
		{name: "inner IP options", pkt: tctest.VXLAN(tctest.IPOpts{}, macPeer, macUnderlay, ulPeer, ulLocal, testVNI, 4789, tctest.Eth(macVTEP, macPeerVTEP, 0x0800, tctest.IPv4(tctest.IPOpts{Options: []byte{1, 1, 1, 0}}, tctest.ProtoTCP, ipRemote, ipLocal, tctest.TCP(80, 40000, tctest.ACK, payload)))), reason: "from_underlay/pass_unsupported", unchanged: true},
		{name: "inner fragment", pkt: ingressTCP(tctest.IPOpts{Frag: 0x2000}, tctest.ACK), reason: "from_underlay/pass_unsupported", unchanged: true},
		{name: "inner SYN", pkt: ingressTCP(tctest.IPOpts{}, tctest.SYN|tctest.ACK), reason: "from_underlay/pass_syn_fin_rst", unchanged: true, filter: true, egressIP: true, ingress: true},
		{name: "inner FIN", pkt: ingressTCP(tctest.IPOpts{}, tctest.FIN|tctest.ACK), reason: "from_underlay/pass_syn_fin_rst", unchanged: true, filter: true, egressIP: true, ingress: true},
		{name: "inner TTL 1", pkt: ingressTCP(tctest.IPOpts{TTL: 1}, tctest.ACK), reason: "from_underlay/pass_ttl", unchanged: true, filter: true, egressIP: true, ingress: true},
		{name: "cold", pkt: ingressTCP(tctest.IPOpts{}, tctest.ACK), reason: "from_underlay/miss_filter", innerMarked: true},
		{name: "no ingress entry", pkt: ingressTCP(tctest.IPOpts{}, tctest.ACK), filter: true, egressIP: true, reason: "from_underlay/miss_ingress", innerMarked: true},
		{name: "reverse check", pkt: ingressTCP(tctest.IPOpts{}, tctest.ACK), filter: true, ingress: true, reason: "from_underlay/pass_reverse_check", unchanged: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			fill(t, c, tc.filter, tc.egressIP, tc.egressHost, tc.ingress)
			var ret uint32
			var out []byte
			d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromUnderlay, tc.pkt) })
			expectCount(t, d, tc.reason)
			if ret != tcNext {
				t.Fatalf("ret %d, want TC_ACT_UNSPEC", ret)
			}
			if tc.unchanged && !bytes.Equal(out, tc.pkt) {
				t.Error("packet changed")
			}
			if tc.innerMarked {
				if tos, _ := ipAt(t, out, 64); tos != markMiss {
					t.Errorf("inner TOS %#x, want the miss mark", tos)
				}
				if binary.BigEndian.Uint16(out[40:]) != 0 {
					t.Error("outer UDP checksum not cleared after changing the inner header")
				}
			}
		})
	}
}

func TestFromUnderlayAntiSpoof(t *testing.T) {
	c := newTestCache(t, Capacity{})
	fill(t, c, true, false, false, true)
	// The inner source lives on another host than the one that sent it.
	if err := c.objs.SkcEgressIp.Put(be32(ipRemote), be32(ulOther)); err != nil {
		t.Fatal(err)
	}
	in := ingressTCP(tctest.IPOpts{}, tctest.ACK)
	var ret uint32
	var out []byte
	d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromUnderlay, in) })
	expectCount(t, d, "from_underlay/pass_reverse_check")
	if ret != tcNext || !bytes.Equal(out, in) {
		t.Error("a spoofed packet was not left to the overlay untouched")
	}
}

// TestFromUnderlayHit: a hit is decapsulated and redirected — to the
// container's side of the veth, or, for a container with an ingress rate
// limit (shaped), to the host veth's egress, where the limit's qdisc is
// (BPF_PROG_RUN shows both as TC_ACT_REDIRECT: hit_shaped tells them
// apart).
func TestFromUnderlayHit(t *testing.T) {
	for _, shaped := range []uint8{0, 1} {
		c := newTestCache(t, Capacity{})
		fill(t, c, true, true, false, true)
		if shaped == 1 {
			var ep skcIngressEp
			if err := c.objs.SkcIngress.Lookup(be32(ipLocal), &ep); err != nil {
				t.Fatal(err)
			}
			ep.Shaped = 1
			if err := c.objs.SkcIngress.Put(be32(ipLocal), ep); err != nil {
				t.Fatal(err)
			}
		}
		in := ingressTCP(tctest.IPOpts{TOS: 0x20}, tctest.ACK|tctest.PSH)
		var ret uint32
		var out []byte
		d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromUnderlay, in) })
		if shaped == 1 {
			expectCount(t, d, "from_underlay/hit", "from_underlay/hit_shaped")
		} else {
			expectCount(t, d, "from_underlay/hit")
		}
		if ret != tcActRedir {
			t.Fatalf("shaped %d: ret %d, want redirect", shaped, ret)
		}
		want := tctest.Eth(macContainer, macBridge, 0x0800, tctest.IPv4(tctest.IPOpts{TOS: 0x20, TTL: 63}, tctest.ProtoTCP, ipRemote, ipLocal, tctest.TCP(80, 40000, tctest.ACK|tctest.PSH, payload)))
		if !bytes.Equal(out, want) {
			t.Errorf("shaped %d: decapsulated packet\n got % x\nwant % x", shaped, out, want)
		}
	}
}

func TestToUnderlayLearns(t *testing.T) {
	c := newTestCache(t, Capacity{})
	in := encapsulatedTCP(tctest.IPOpts{TOS: 0x20 | markMiss | markEst})
	var ret uint32
	var out []byte
	d := delta(t, c, func() { ret, out = fromOverlay(t, c.objs.ToUnderlay, in) })
	expectCount(t, d, "to_underlay/learn")
	if ret != tcNext || len(out) != len(in) {
		t.Fatalf("ret %d len %d", ret, len(out))
	}
	if tos, _ := ipAt(t, out, 64); tos != 0x20 {
		t.Errorf("inner TOS %#x: marks not cleared or DSCP damaged", tos)
	}
	var host [4]byte
	if err := c.objs.SkcEgressIp.Lookup(be32(ipRemote), &host); err != nil || addr(host) != ulPeer {
		t.Errorf("egress IP entry: %v %v", addr(host), err)
	}
	var eh skcEgressHost
	if err := c.objs.SkcEgressHost.Lookup(be32(ulPeer), &eh); err != nil || !bytes.Equal(eh.Hdr[:], in[:64]) || eh.Ifindex != 1 {
		t.Errorf("egress host entry: %v ifindex %d, headers match: %v", err, eh.Ifindex, bytes.Equal(eh.Hdr[:], in[:64]))
	}
	var f skcFilterVal
	k := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40000), Rport: ntohs(80), Proto: tctest.ProtoTCP}
	if err := c.objs.SkcFilter.Lookup(k, &f); err != nil || f.Egress != 1 || f.Ingress != 0 {
		t.Errorf("filter entry %+v %v, want egress only", f, err)
	}
}

// fromOverlay runs to_underlay on a packet the overlay forwarded into its
// VXLAN device (it carries LearnMark).
func fromOverlay(t *testing.T, prog *ebpf.Program, in []byte) (uint32, []byte) {
	t.Helper()
	ret, out, _ := tctest.RunSkb(t, prog, in, &tctest.Skb{Mark: LearnMark})
	return ret, out
}

// TestToUnderlayIgnoresLookAlikes: a VXLAN frame that did not come from the
// overlay device — a container's or a host process's datagram to some
// address's VXLAN port, with both marks in its inner header — teaches
// nothing and is not changed (the cache poisoning of issue 25).
func TestToUnderlayIgnoresLookAlikes(t *testing.T) {
	c := newTestCache(t, Capacity{})
	in := encapsulatedTCP(tctest.IPOpts{TOS: 0x20 | markMiss | markEst})
	for _, mark := range []uint32{0, LearnMark ^ 0xffffffff} {
		var ret uint32
		var out []byte
		d := delta(t, c, func() { ret, out, _ = tctest.RunSkb(t, c.objs.ToUnderlay, in, &tctest.Skb{Mark: mark}) })
		expectCount(t, d, "to_underlay/pass_not_overlay")
		if ret != tcNext || !bytes.Equal(out[:len(in)], in) {
			t.Errorf("mark %#x: ret %d, packet changed: %v", mark, ret, !bytes.Equal(out[:len(in)], in))
		}
	}
	for _, m := range []*ebpf.Map{c.objs.SkcEgressIp, c.objs.SkcEgressHost, c.objs.SkcFilter} {
		if n := count(t, m); n != 0 {
			t.Errorf("%v: %d entries learned", m, n)
		}
	}
}

func TestToUnderlayDoesNotLearn(t *testing.T) {
	for _, tc := range []struct {
		name, reason string
		tos          byte
		pause        bool
		unchanged    bool
	}{
		{"unmarked", "to_underlay/pass", 0x20, false, true},
		{"miss only", "to_underlay/marks_cleared", markMiss, false, false},
		{"established only", "to_underlay/marks_cleared", markEst, false, false},
		{"paused", "to_underlay/paused", markMiss | markEst, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			if err := c.SetPaused(tc.pause); err != nil {
				t.Fatal(err)
			}
			in := encapsulatedTCP(tctest.IPOpts{TOS: tc.tos})
			var out []byte
			d := delta(t, c, func() { _, out = fromOverlay(t, c.objs.ToUnderlay, in) })
			expectCount(t, d, tc.reason)
			if tos, _ := ipAt(t, out, 64); tos&(markMiss|markEst) != 0 {
				t.Errorf("marks left on: %#x", tos)
			}
			if tc.unchanged && !bytes.Equal(out, in) {
				t.Error("packet changed")
			}
			if n := count(t, c.objs.SkcEgressHost); n != 0 {
				t.Errorf("%d egress entries learned", n)
			}
		})
	}
}

func count(t testing.TB, m *ebpf.Map) int {
	t.Helper()
	n := 0
	it := m.Iterate()
	var k, v []byte
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestToContainer(t *testing.T) {
	deliver := func(tos byte) []byte {
		return tctest.Eth(macContainer, macBridge, 0x0800, tctest.IPv4(tctest.IPOpts{TOS: tos, TTL: 62}, tctest.ProtoTCP, ipRemote, ipLocal, tctest.TCP(80, 40000, tctest.ACK, payload)))
	}
	t.Run("learns", func(t *testing.T) {
		c := newTestCache(t, Capacity{})
		if err := c.objs.SkcIngress.Put(be32(ipLocal), skcIngressEp{Ifindex: 9}); err != nil {
			t.Fatal(err)
		}
		var out []byte
		d := delta(t, c, func() { _, out = tctest.Run(t, c.objs.ToContainer, deliver(0x20|markMiss|markEst)) })
		expectCount(t, d, "to_container/learn")
		if tos, _ := ipAt(t, out, 14); tos != 0x20 {
			t.Errorf("TOS %#x after learning", tos)
		}
		var ep skcIngressEp
		if err := c.objs.SkcIngress.Lookup(be32(ipLocal), &ep); err != nil || ep.Ready != 1 || ep.Ifindex != 9 ||
			!bytes.Equal(ep.MacDst[:], macContainer) || !bytes.Equal(ep.MacSrc[:], macBridge) {
			t.Errorf("ingress entry %+v %v", ep, err)
		}
		var f skcFilterVal
		k := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40000), Rport: ntohs(80), Proto: tctest.ProtoTCP}
		if err := c.objs.SkcFilter.Lookup(k, &f); err != nil || f.Ingress != 1 || f.Egress != 0 {
			t.Errorf("filter entry %+v %v, want ingress only", f, err)
		}
	})
	for _, tc := range []struct {
		name, reason string
		tos          byte
		endpoint     bool
	}{
		{"unmarked", "to_container/pass", 0, true},
		{"unknown endpoint", "to_container/marks_cleared", markMiss | markEst, false},
		{"miss only", "to_container/marks_cleared", markMiss, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			if tc.endpoint {
				c.objs.SkcIngress.Put(be32(ipLocal), skcIngressEp{Ifindex: 9})
			}
			in := deliver(tc.tos)
			var out []byte
			d := delta(t, c, func() { _, out = tctest.Run(t, c.objs.ToContainer, in) })
			expectCount(t, d, tc.reason)
			if tos, _ := ipAt(t, out, 14); tos != 0 {
				t.Errorf("TOS %#x", tos)
			}
			var ep skcIngressEp
			if c.objs.SkcIngress.Lookup(be32(ipLocal), &ep) == nil && ep.Ready != 0 {
				t.Error("learned from a packet without both marks")
			}
		})
	}
}

// TestFullCaches: LRU maps never refuse an insert; learning at capacity
// evicts old entries instead of failing, and traffic keeps flowing.
func TestFullCaches(t *testing.T) {
	c := newTestCache(t, Capacity{EgressIPs: 4, EgressHosts: 2, Ingress: 2, Filter: 4, Connections: 4})
	for i := range 20 {
		in := encapsulatedTCP(tctest.IPOpts{TOS: markMiss | markEst})
		in[64+19] = byte(i) // a new remote container each time
		binary.BigEndian.PutUint16(in[64+10:], 0)
		binary.BigEndian.PutUint16(in[64+10:], tctest.Csum(in[64:84]))
		if ret, _ := fromOverlay(t, c.objs.ToUnderlay, in); ret != tcNext {
			t.Fatalf("learning #%d at capacity: ret %d", i, ret)
		}
	}
	if n := count(t, c.objs.SkcEgressIp); n > 4 {
		t.Errorf("%d entries in a map of 4", n)
	}
}

func TestPurgeDeniedAndSync(t *testing.T) {
	c := newTestCache(t, Capacity{})
	fill(t, c, true, true, true, true)
	other := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40001), Rport: ntohs(443), Proto: tctest.ProtoTCP}
	c.objs.SkcFilter.Put(other, skcFilterVal{Egress: 1, Ingress: 1})
	set, _ := policy.NewSet([]policy.Rule{{ID: "web", Action: policy.Deny, Dst: netip.PrefixFrom(ipRemote, 32), Proto: policy.TCP, Port: 80}})
	n, err := c.PurgeDenied(set)
	if err != nil || n != 1 || count(t, c.objs.SkcFilter) != 1 {
		t.Fatalf("purged %d (%v), %d left; want exactly the port-80 flow gone", n, err, count(t, c.objs.SkcFilter))
	}
	hosts := []cluster.Host{
		{Name: "h1", UnderlayIP: ulLocal, Subnet: netip.MustParsePrefix("10.244.1.0/24")},
		{Name: "h2", UnderlayIP: ulPeer, Subnet: netip.MustParsePrefix("10.244.2.0/24")},
	}
	eps := []cluster.Endpoint{
		{Host: "h1", IP: netip.PrefixFrom(ipLocal, 24)},
		{Host: "h2", IP: netip.PrefixFrom(ipRemote, 24)},
	}
	if err := c.Sync(eps, hosts); err != nil {
		t.Fatal(err)
	}
	// The remote container and h2's VTEP address are known from the
	// store, before any packet.
	if count(t, c.objs.SkcEgressIp) != 2 || count(t, c.objs.SkcEgressHost) != 1 || count(t, c.objs.SkcIngress) != 1 || count(t, c.objs.SkcFilter) != 1 {
		t.Fatal("Sync removed live entries")
	}
	// The remote container moves to h3 (host move): everything naming it
	// through h2 goes, and h2's headers stay while h2 lives.
	hosts = append(hosts, cluster.Host{Name: "h3", UnderlayIP: ulOther, Subnet: netip.MustParsePrefix("10.244.3.0/24")})
	eps[1].Host = "h3"
	if err := c.Sync(eps, hosts); err != nil {
		t.Fatal(err)
	}
	var host [4]byte
	if err := c.objs.SkcEgressIp.Lookup(be32(ipRemote), &host); err != nil || addr(host) != ulOther {
		t.Errorf("egress entry of the moved container: %s (%v), want its new host %s", addr(host), err, ulOther)
	}
	// The remote endpoint is deleted, then h2 leaves.
	if err := c.Sync(eps[:1], hosts[:1]); err != nil {
		t.Fatal(err)
	}
	if count(t, c.objs.SkcEgressHost) != 0 || count(t, c.objs.SkcFilter) != 0 {
		t.Error("entries of a departed host or deleted endpoint survived")
	}
	if count(t, c.objs.SkcIngress) != 1 {
		t.Error("the local endpoint's entry went")
	}
	if err := c.RemoveEndpoint(eps[0]); err != nil || count(t, c.objs.SkcIngress) != 0 {
		t.Errorf("RemoveEndpoint: %v", err)
	}
}

// busyHost fills c as on a host of a large cluster: flows between its 100
// containers and 3 968 containers on 64 other hosts, and returns the
// endpoints and hosts that make every entry live.
func busyHost(t testing.TB, c *fastPath) ([]cluster.Endpoint, []cluster.Host) {
	hosts := []cluster.Host{{Name: "h1", UnderlayIP: ulLocal, Subnet: netip.MustParsePrefix("10.244.1.0/24")}}
	var eps []cluster.Endpoint
	put := func(m *ebpf.Map, key, val any) {
		if err := m.Put(key, val); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 100 {
		ip := netip.AddrFrom4([4]byte{10, 244, 1, byte(2 + i)})
		eps = append(eps, cluster.Endpoint{Host: "h1", IP: netip.PrefixFrom(ip, 24)})
		put(c.objs.SkcIngress, be32(ip), skcIngressEp{Ifindex: uint32(10 + i), Ready: 1})
	}
	var remote []netip.Addr
	for h := range 64 {
		ul := netip.AddrFrom4([4]byte{10, 99, 1, byte(h)})
		hosts = append(hosts, cluster.Host{Name: fmt.Sprint("r", h), UnderlayIP: ul,
			Subnet: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 245, byte(h), 0}), 24)})
		put(c.objs.SkcEgressHost, be32(ul), skcEgressHost{Ifindex: 7})
		for i := range 62 {
			ip := netip.AddrFrom4([4]byte{10, 245, byte(h), byte(2 + i)})
			remote = append(remote, ip)
			eps = append(eps, cluster.Endpoint{Host: fmt.Sprint("r", h), IP: netip.PrefixFrom(ip, 24)})
			put(c.objs.SkcEgressIp, be32(ip), be32(ul))
		}
	}
	for i := range 12000 {
		k := skcFlowKey{Laddr: be32(eps[i%100].IP.Addr()), Raddr: be32(remote[i%len(remote)]),
			Lport: ntohs(uint16(30000 + i)), Rport: ntohs(80), Proto: tctest.ProtoTCP}
		put(c.objs.SkcFilter, k, skcFilterVal{Egress: 1, Ingress: 1})
	}
	return eps, hosts
}

// A cluster change on a busy host: Sync reads every entry and deletes those
// of departed containers and hosts, in batches.
func TestSyncBusyHost(t *testing.T) {
	c := newTestCache(t, Capacity{})
	eps, hosts := busyHost(t, c)
	if err := c.Sync(eps, hosts); err != nil {
		t.Fatal(err)
	}
	if n := count(t, c.objs.SkcFilter); n != 12000 {
		t.Fatalf("%d flows after a sync that changes nothing, want 12000", n)
	}
	// Host r0 leaves with its 62 containers, and the local containers
	// from the 51st on go: their flows and entries with them.
	keep := slices.Clone(eps[:50])
	for _, e := range eps[100:] {
		if e.Host != "r0" {
			keep = append(keep, e)
		}
	}
	if err := c.Sync(keep, append(hosts[:1:1], hosts[2:]...)); err != nil {
		t.Fatal(err)
	}
	flows, err := bpfmap.Entries[skcFlowKey, skcFilterVal](c.objs.SkcFilter)
	if err != nil {
		t.Fatal(err)
	}
	// Flow i joins local i%100 and remote i%3968 (r0's are 0–61).
	want := 0
	for i := range 12000 {
		if i%100 < 50 && i%3968 >= 62 {
			want++
		}
	}
	if len(flows) != want {
		t.Errorf("%d flows left, want %d", len(flows), want)
	}
	for k := range flows {
		if l := addr32(k.Laddr).As4(); l[3] >= 52 {
			t.Fatalf("a flow of removed local container %s survived", addr32(k.Laddr))
		}
		if r := addr32(k.Raddr).As4(); r[2] == 0 {
			t.Fatalf("a flow of r0's container %s survived", addr32(k.Raddr))
		}
	}
	if n := count(t, c.objs.SkcIngress); n != 50 {
		t.Errorf("%d ingress entries, want 50", n)
	}
	if n := count(t, c.objs.SkcEgressIp); n != 63*62+63 { // and each host's VTEP address
		t.Errorf("%d egress entries, want %d", n, 63*62+63)
	}
	if n := count(t, c.objs.SkcEgressHost); n != 63 {
		t.Errorf("%d egress hosts, want 63", n)
	}
}

// BenchmarkSync measures a cluster change on a busy host that leaves its
// caches as they are (what every host pays for every change elsewhere).
func BenchmarkSync(b *testing.B) {
	c := newTestCache(b, Capacity{})
	eps, hosts := busyHost(b, c)
	for b.Loop() {
		if err := c.Sync(eps, hosts); err != nil {
			b.Fatal(err)
		}
	}
}

// More remote containers than skc_egress_ip holds: Sync preloads as many
// as fit and leaves the rest to the programs' learning, and a second Sync
// writes nothing (it would evict, at every sync, what flows are using).
func TestSyncEgressBeyondCapacity(t *testing.T) {
	capacity := DefaultCapacity
	capacity.EgressIPs = 64
	c := newTestCache(t, capacity)
	hosts := []cluster.Host{{Name: "h1", UnderlayIP: ulLocal, Subnet: netip.MustParsePrefix("10.244.1.0/24")},
		{Name: "r1", UnderlayIP: ulPeer, Subnet: netip.MustParsePrefix("10.244.2.0/24")}}
	var eps []cluster.Endpoint
	for i := range 100 {
		ip := netip.AddrFrom4([4]byte{10, 244, 2, byte(2 + i)})
		eps = append(eps, cluster.Endpoint{Host: "r1", IP: netip.PrefixFrom(ip, 24)})
	}
	if err := c.Sync(eps, hosts); err != nil {
		t.Fatal(err)
	}
	first, err := bpfmap.Entries[[4]byte, [4]byte](c.objs.SkcEgressIp)
	if err != nil {
		t.Fatal(err)
	}
	// 101 remote addresses (100 containers and r1's VTEP) for 64 places
	if len(first) != 64 || c.unloaded != 101-64 {
		t.Fatalf("%d entries, %d unloaded; want 64 and 37", len(first), c.unloaded)
	}
	if err := c.Sync(eps, hosts); err != nil {
		t.Fatal(err)
	}
	second, err := bpfmap.Entries[[4]byte, [4]byte](c.objs.SkcEgressIp)
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(first, second) {
		t.Errorf("a second sync changed the entries: %d of them, was %d", len(second), len(first))
	}
}
