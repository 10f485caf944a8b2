package cache

import (
	"bytes"
	"errors"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/tc/tctest"
)

// Golden-packet tests of the connection table (flows.h): a connection's
// SYN judged by the compiled policy, its segments both ways by the entry.

var connKey = skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40000), Rport: ntohs(80), Proto: tctest.ProtoTCP}

// judging compiles set for the local container (nil: no rules, all allowed).
func judging(t *testing.T, c *fastPath, set policy.Set) {
	t.Helper()
	if err := c.SyncPolicy(set, []netip.Addr{ipLocal}); err != nil {
		t.Fatal(err)
	}
}

func connState(t *testing.T, c *fastPath) (skcFlowState, bool) {
	t.Helper()
	var s skcFlowState
	err := c.objs.SkcFlows.Lookup(connKey, &s)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return s, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return s, true
}

func deny80(t *testing.T) policy.Set {
	set, err := policy.NewSet([]policy.Rule{{ID: "web", Action: policy.Deny, Dst: netip.PrefixFrom(ipRemote, 32), Proto: policy.TCP, Port: 80}})
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// TestOutboundSYN: a local container's SYN opens a connection only when
// the policy allows it and both ways are known; everything else leaves the
// SYN to the overlay untouched.
func TestOutboundSYN(t *testing.T) {
	for _, tc := range []struct {
		name     string
		judge    bool
		set      policy.Set
		paused   bool
		paths    bool // egress IP, headers and the local ingress entry
		capacity uint32
		reasons  []string
		opened   bool
	}{
		{name: "allowed", judge: true, paths: true, reasons: []string{"from_container/table_open", "from_container/table_hit", "from_container/hit"}, opened: true},
		{name: "denied", judge: true, set: deny80(t), paths: true, reasons: []string{"from_container/new_denied"}},
		{name: "policy not compiled", paths: true, reasons: []string{"from_container/new_unjudged"}},
		{name: "policy being changed", judge: true, paused: true, paths: true, reasons: []string{"from_container/new_unjudged"}},
		{name: "no path", judge: true, reasons: []string{"from_container/table_no_path"}},
		{name: "table full", judge: true, paths: true, capacity: 1, reasons: []string{"from_container/table_full"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{EgressIPs: 8, EgressHosts: 8, Ingress: 8, Filter: 8, Connections: max(tc.capacity, 8)})
			fill(t, c, false, tc.paths, tc.paths, tc.paths)
			if tc.judge {
				judging(t, c, tc.set)
			}
			if tc.paused {
				if err := c.SetPaused(true); err != nil {
					t.Fatal(err)
				}
			}
			if tc.capacity != 0 {
				fillTable(t, c)
			}
			in := egressTCP(tctest.IPOpts{}, tctest.SYN)
			ret, out, s := synOutcome(t, c, c.objs.FromContainer, in, tc.reasons, tc.opened)
			if !tc.opened {
				return
			}
			if ret != tcActRedir || len(out) != len(in)+ENCAP {
				t.Fatalf("ret %d, %d bytes: want the SYN encapsulated and redirected", ret, len(out))
			}
			if s.State != stSynSent || s.Outbound != 1 || s.Fin != 0 || s.Seen == 0 {
				t.Errorf("entry %+v, want SYN_SENT outbound with a time", s)
			}
		})
	}
}

// synOutcome runs a SYN through prog and checks the counters that moved
// and whether it opened connKey's entry; a SYN that opened nothing must go
// on to the overlay untouched. It returns what the program returned.
func synOutcome(t *testing.T, c *fastPath, prog *ebpf.Program, in []byte, reasons []string, opened bool) (uint32, []byte, skcFlowState) {
	t.Helper()
	var ret uint32
	var out []byte
	d := delta(t, c, func() { ret, out = tctest.Run(t, prog, in) })
	expectCount(t, d, reasons...)
	s, ok := connState(t, c)
	if ok != opened {
		t.Fatalf("connection opened: %v, want %v", ok, opened)
	}
	if !opened && (ret != tcNext || !bytes.Equal(out, in)) {
		t.Errorf("ret %d, packet changed %v: want it on to the overlay untouched", ret, !bytes.Equal(out, in))
	}
	return ret, out, s
}

// ENCAP is what encapsulation adds.
const ENCAP = 50

// fillTable fills the table with connections other than connKey.
func fillTable(t *testing.T, c *fastPath) {
	t.Helper()
	for i := range c.objs.SkcFlows.MaxEntries() {
		k := connKey
		k.Lport = ntohs(uint16(41000 + i))
		if err := c.objs.SkcFlows.Put(k, skcFlowState{State: stEstablished, Outbound: 1}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestConnectionLifetime follows one outbound connection through the
// table: handshake, data both ways, the two FINs and the last ACK, which
// ends the entry; and a RST, which ends it at once.
func TestConnectionLifetime(t *testing.T) {
	c := newTestCache(t, Capacity{})
	fill(t, c, false, true, true, true)
	judging(t, c, nil)
	out := func(flags byte) uint32 {
		ret, _ := tctest.Run(t, c.objs.FromContainer, egressTCP(tctest.IPOpts{}, flags))
		return ret
	}
	in := func(flags byte) uint32 {
		ret, got := tctest.Run(t, c.objs.FromUnderlay, ingressTCP(tctest.IPOpts{}, flags))
		if ret == tcActRedir && len(got) != len(ingressTCP(tctest.IPOpts{}, flags))-ENCAP {
			t.Fatalf("a delivered segment of %d bytes", len(got))
		}
		return ret
	}
	steps := []struct {
		name  string
		send  func(byte) uint32
		flags byte
		state uint8 // 0: the entry is gone
		fin   uint8
	}{
		{"SYN", out, tctest.SYN, stSynSent, 0},
		{"SYN-ACK", in, tctest.SYN | tctest.ACK, stSynSent, 0},
		{"ACK", out, tctest.ACK, stEstablished, 0},
		{"data in", in, tctest.ACK | tctest.PSH, stEstablished, 0},
		{"FIN out", out, tctest.FIN | tctest.ACK, stClosing, 1},
		{"FIN in", in, tctest.FIN | tctest.ACK, stClosing, 3},
		{"last ACK", out, tctest.ACK, 0, 0},
	}
	for _, st := range steps {
		var ret uint32
		d := delta(t, c, func() { ret = st.send(st.flags) })
		if ret != tcActRedir {
			t.Fatalf("%s: ret %d, want the fast path (counters %v)", st.name, ret, d)
		}
		s, ok := connState(t, c)
		if st.state == 0 {
			if ok {
				t.Fatalf("%s: entry %+v left", st.name, s)
			}
			continue
		}
		if !ok || s.State != st.state || s.Fin != st.fin {
			t.Fatalf("%s: entry %+v (there: %v), want state %d fin %d", st.name, s, ok, st.state, st.fin)
		}
	}
	// After the entry, a late segment takes the overlay.
	if ret := in(tctest.ACK); ret != tcNext {
		t.Errorf("a segment after the close: ret %d, want the overlay", ret)
	}
	// A reset ends a connection at once, whichever way it goes.
	out(tctest.SYN)
	if ret := in(tctest.RST | tctest.ACK); ret != tcActRedir {
		t.Fatalf("RST: ret %d, want the fast path", ret)
	}
	if s, ok := connState(t, c); ok {
		t.Errorf("entry %+v left after a RST", s)
	}
}

// TestInboundSYN: a remote container's SYN is judged by the ingress
// policy, after the source check, and opens a connection only to a socket
// of the container's own namespace (another layer may serve its address
// from the host stack).
func TestInboundSYN(t *testing.T) {
	nsid, closeNS := listenerNetns(t, unix.SOCK_STREAM, 40000)
	defer closeNS()
	for _, tc := range []struct {
		name    string
		set     policy.Set
		source  netip.Addr // the inner source's host, as this host knows it
		nsid    int32
		reasons []string
		opened  bool
	}{
		{name: "allowed, listener", source: ulPeer, nsid: nsid, reasons: []string{"from_underlay/table_open", "from_underlay/table_hit", "from_underlay/hit"}, opened: true},
		{name: "no socket in the container", source: ulPeer, nsid: -1, reasons: []string{"from_underlay/new_no_listener"}},
		{name: "denied", set: denyFrom(t), source: ulPeer, nsid: nsid, reasons: []string{"from_underlay/new_denied"}},
		{name: "forged source", source: ulOther, nsid: nsid, reasons: []string{"from_underlay/pass_syn_fin_rst"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			fill(t, c, false, true, true, true)
			if err := c.objs.SkcEgressIp.Put(be32(ipRemote), be32(tc.source)); err != nil {
				t.Fatal(err)
			}
			localNetns(t, c, tc.nsid)
			judging(t, c, tc.set)
			in := ingressTCP(tctest.IPOpts{}, tctest.SYN)
			ret, out, s := synOutcome(t, c, c.objs.FromUnderlay, in, tc.reasons, tc.opened)
			if !tc.opened {
				return
			}
			if ret != tcActRedir || len(out) != len(in)-ENCAP {
				t.Fatalf("ret %d, %d bytes: want the SYN decapsulated and redirected", ret, len(out))
			}
			if s.State != stSynRecv || s.Outbound != 0 {
				t.Errorf("entry %+v, want SYN_RECV inbound", s)
			}
			// The local container's SYN-ACK goes by the entry.
			d := delta(t, c, func() {
				ret, _ = tctest.Run(t, c.objs.FromContainer, egressTCP(tctest.IPOpts{}, tctest.SYN|tctest.ACK))
			})
			if ret != tcActRedir {
				t.Errorf("SYN-ACK: ret %d (counters %v), want the fast path", ret, d)
			}
		})
	}
}

// localNetns gives the local container's ingress entry the namespace id
// nsid (-1: none).
func localNetns(t *testing.T, c *fastPath, nsid int32) {
	t.Helper()
	var ep skcIngressEp
	if err := c.objs.SkcIngress.Lookup(be32(ipLocal), &ep); err != nil {
		t.Fatal(err)
	}
	ep.NetnsId = nsid
	if err := c.objs.SkcIngress.Put(be32(ipLocal), ep); err != nil {
		t.Fatal(err)
	}
}

// denyFrom denies the remote container's TCP to the local one's port 40000.
func denyFrom(t *testing.T) policy.Set {
	set, err := policy.NewSet([]policy.Rule{{ID: "in", Action: policy.Deny, Src: netip.PrefixFrom(ipRemote, 32),
		Dst: netip.PrefixFrom(ipLocal, 32), Proto: policy.TCP, Port: 40000}})
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// listenerNetns makes a network namespace with a socket of type typ (a
// listening TCP socket, or a bound UDP one) on port and returns its id in
// this namespace.
func listenerNetns(t *testing.T, typ, port int) (int32, func()) {
	t.Helper()
	type result struct {
		ns, sock int
		err      error
	}
	done := make(chan result)
	go func() {
		// The thread enters the new namespace and is never reused.
		runtime.LockOSThread()
		var r result
		defer func() { done <- r }()
		if r.err = unix.Unshare(unix.CLONE_NEWNET); r.err != nil {
			return
		}
		if r.ns, r.err = unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0); r.err != nil {
			return
		}
		if r.sock, r.err = unix.Socket(unix.AF_INET, typ|unix.SOCK_CLOEXEC, 0); r.err != nil {
			return
		}
		if r.err = unix.Bind(r.sock, &unix.SockaddrInet4{Port: port}); r.err != nil || typ != unix.SOCK_STREAM {
			return
		}
		r.err = unix.Listen(r.sock, 1)
	}()
	r := <-done
	if r.err != nil {
		t.Fatalf("namespace with a listener: %v", r.err)
	}
	id, err := netnsID(r.ns)
	if err != nil {
		t.Fatal(err)
	}
	return id, func() {
		unix.Close(r.sock)
		unix.Close(r.ns)
	}
}

// TestPurgeConnections: a policy change ends the table's connections it
// denies the way they were opened, and no others: a connection's replies
// pass whatever the rules say of their direction, as with conntrack.
func TestPurgeConnections(t *testing.T) {
	c := newTestCache(t, Capacity{})
	inbound := connKey
	inbound.Lport = ntohs(40001)
	for k, s := range map[skcFlowKey]skcFlowState{
		connKey: {State: stEstablished, Outbound: 1}, // ipLocal:40000 → ipRemote:80
		inbound: {State: stEstablished},              // ipRemote:80 → ipLocal:40001
	} {
		if err := c.objs.SkcFlows.Put(k, s); err != nil {
			t.Fatal(err)
		}
	}
	// Denies the replies' direction of the outbound connection only.
	reverse, err := policy.NewSet([]policy.Rule{{ID: "r", Action: policy.Deny, Src: netip.PrefixFrom(ipRemote, 32), Proto: policy.TCP, Port: 40000}})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := c.PurgeDenied(reverse); err != nil || n != 0 {
		t.Fatalf("purged %d (%v), want none", n, err)
	}
	if n, err := c.PurgeDenied(deny80(t)); err != nil || n != 1 {
		t.Fatalf("purged %d (%v), want the outbound connection", n, err)
	}
	if _, ok := connState(t, c); ok {
		t.Error("the denied connection is still in the table")
	}
	if count(t, c.objs.SkcFlows) != 1 {
		t.Error("the inbound connection went too")
	}
}

// TestOpenedAgainstDatagrams: UDP flows are judged by their port, ICMP
// echoes by protocol only (their identifier is no port).
func TestOpenedAgainstDatagrams(t *testing.T) {
	set, err := policy.NewSet([]policy.Rule{
		{ID: "dns", Action: policy.Deny, Dst: netip.PrefixFrom(ipRemote, 32), Proto: policy.UDP, Port: 53},
		{ID: "ping", Action: policy.Deny, Src: netip.PrefixFrom(ipRemote, 32), Proto: policy.ICMP},
	})
	if err != nil {
		t.Fatal(err)
	}
	flow := func(proto uint8, lport, rport uint16) skcFlowKey {
		return skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(lport), Rport: ntohs(rport), Proto: proto}
	}
	for _, tc := range []struct {
		name     string
		k        skcFlowKey
		outbound uint8
		denied   bool
	}{
		{"query to 53", flow(unix.IPPROTO_UDP, 40000, 53), 1, true},
		{"query to 54", flow(unix.IPPROTO_UDP, 40000, 54), 1, false},
		{"query from the remote's 53", flow(unix.IPPROTO_UDP, 40000, 53), 0, false},
		{"ping out", flow(unix.IPPROTO_ICMP, 7, 7), 1, false},
		{"ping in", flow(unix.IPPROTO_ICMP, 7, 7), 0, true},
	} {
		if got := openedAgainst(set, tc.k, skcFlowState{State: stEstablished, Outbound: tc.outbound}); got != tc.denied {
			t.Errorf("%s: denied %v, want %v", tc.name, got, tc.denied)
		}
	}
}

// TestExpire: flows idle past their protocol's and state's conntrack
// timeout end; others stay.
func TestExpire(t *testing.T) {
	c := newTestCache(t, Capacity{})
	now, err := monotonicCoarse()
	if err != nil {
		t.Fatal(err)
	}
	ago := func(d time.Duration) uint64 { return now - uint64(d) }
	lim := timeouts()
	synSent := lim[class{unix.IPPROTO_TCP, stSynSent}]
	udp := lim[class{unix.IPPROTO_UDP, stSynSent}]
	icmp := lim[class{unix.IPPROTO_ICMP, stEstablished}]
	type flow struct {
		proto uint8
		s     skcFlowState
		stays bool
	}
	flows := map[uint16]flow{
		1: {unix.IPPROTO_TCP, skcFlowState{State: stSynSent, Seen: ago(synSent + 10*time.Second)}, false},    // never answered
		2: {unix.IPPROTO_TCP, skcFlowState{State: stSynSent, Seen: ago(time.Second)}, true},                  // just sent
		3: {unix.IPPROTO_TCP, skcFlowState{State: stEstablished, Seen: ago(synSent + 10*time.Second)}, true}, // idle, but established
		4: {unix.IPPROTO_TCP, skcFlowState{State: 9, Seen: now}, false},                                      // no state the programs write
		5: {unix.IPPROTO_UDP, skcFlowState{State: stSynSent, Seen: ago(udp + 10*time.Second)}, false},        // never replied
		6: {unix.IPPROTO_UDP, skcFlowState{State: stEstablished, Seen: ago(udp + 10*time.Second)}, true},     // a replied stream lasts longer
		7: {unix.IPPROTO_ICMP, skcFlowState{State: stEstablished, Seen: ago(icmp + 10*time.Second)}, false},  // an old echo
		8: {unix.IPPROTO_ICMP, skcFlowState{State: stSynRecv, Seen: ago(time.Second)}, true},                 // a fresh one
	}
	key := func(p uint16, proto uint8) skcFlowKey {
		k := connKey
		k.Lport, k.Proto = p, proto
		return k
	}
	for p, f := range flows {
		if err := c.objs.SkcFlows.Put(key(p, f.proto), f.s); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := c.expire(); err != nil || n != 4 {
		t.Fatalf("expired %d (%v), want 4", n, err)
	}
	for p, f := range flows {
		var s skcFlowState
		err := c.objs.SkcFlows.Lookup(key(p, f.proto), &s)
		if stays := err == nil; stays != f.stays {
			t.Errorf("flow %d (protocol %d, state %d) stayed: %v, want %v", p, f.proto, f.s.State, stays, f.stays)
		}
	}
}

// localTCP is a segment from the local container to another container of
// this host (ipLocal2), or back (reply).
func localTCP(reply bool, flags byte) []byte {
	if reply {
		return tctest.Eth(macContainer, macContainer2, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, ipLocal2, ipLocal, tctest.TCP(80, 40000, flags, payload)))
	}
	return tctest.Eth(macContainer2, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, ipLocal, ipLocal2, tctest.TCP(40000, 80, flags, payload)))
}

// twoLocal gives both local containers complete ingress entries, the
// second one's namespace nsid.
func twoLocal(t *testing.T, c *fastPath, nsid int32) {
	t.Helper()
	for i, a := range []netip.Addr{ipLocal, ipLocal2} {
		ep := skcIngressEp{Ifindex: uint32(9 + i), Ready: 1, NetnsId: -1}
		copy(ep.MacDst[:], []net.HardwareAddr{macContainer, macContainer2}[i])
		copy(ep.MacSrc[:], macBridge)
		if i == 1 {
			ep.NetnsId = nsid
		}
		if err := c.objs.SkcIngress.Put(be32(a), ep); err != nil {
			t.Fatal(err)
		}
	}
}

// TestLocalConnections: TCP between two containers of this host goes by
// the table from its SYN — judged by the sender's egress and the
// receiver's ingress verdicts, to a socket of the receiver's namespace —
// straight into the receiver's namespace, both ways, until it closes.
func TestLocalConnections(t *testing.T) {
	nsid, closeNS := listenerNetns(t, unix.SOCK_STREAM, 80)
	defer closeNS()
	denyIn, err := policy.NewSet([]policy.Rule{{ID: "in", Action: policy.Deny, Dst: netip.PrefixFrom(ipLocal2, 32), Proto: policy.TCP, Port: 80}})
	if err != nil {
		t.Fatal(err)
	}
	denyOut, err := policy.NewSet([]policy.Rule{{ID: "out", Action: policy.Deny, Src: netip.PrefixFrom(ipLocal, 32), Proto: policy.TCP}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		set     policy.Set
		nsid    int32
		pkt     []byte
		reasons []string
		opened  bool
	}{
		{name: "allowed", nsid: nsid, pkt: localTCP(false, tctest.SYN), reasons: []string{"from_container/local_table_open", "from_container/local_table_hit"}, opened: true},
		{name: "receiver's ingress denies", set: denyIn, nsid: nsid, pkt: localTCP(false, tctest.SYN), reasons: []string{"from_container/local_new_denied"}},
		{name: "sender's egress denies", set: denyOut, nsid: nsid, pkt: localTCP(false, tctest.SYN), reasons: []string{"from_container/local_new_denied"}},
		{name: "no socket in the receiver", nsid: -1, pkt: localTCP(false, tctest.SYN), reasons: []string{"from_container/local_new_no_listener"}},
		{name: "not in the table", nsid: nsid, pkt: localTCP(false, tctest.ACK), reasons: []string{"from_container/local_pass"}},
		{name: "to the gateway", nsid: nsid, pkt: tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, ipLocal, netip.MustParseAddr("10.244.1.1"), tctest.TCP(40000, 80, tctest.SYN, payload))), reasons: []string{"from_container/local_pass"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			twoLocal(t, c, tc.nsid)
			if err := c.SyncPolicy(tc.set, []netip.Addr{ipLocal, ipLocal2}); err != nil {
				t.Fatal(err)
			}
			var ret uint32
			var out []byte
			d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromContainer, tc.pkt) })
			expectCount(t, d, tc.reasons...)
			key := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipLocal2), Lport: ntohs(40000), Rport: ntohs(80), Proto: tctest.ProtoTCP}
			var s skcFlowState
			opened := c.objs.SkcFlows.Lookup(key, &s) == nil
			if opened != tc.opened {
				t.Fatalf("connection opened: %v, want %v", opened, tc.opened)
			}
			if !tc.opened {
				if ret != tcNext || !bytes.Equal(out, tc.pkt) {
					t.Errorf("ret %d: want the segment on to the bridge untouched", ret)
				}
				return
			}
			if ret != tcActRedir || !bytes.Equal(out, tc.pkt) {
				t.Fatalf("ret %d, frame changed %v: want it redirected as it is", ret, !bytes.Equal(out, tc.pkt))
			}
			if s.State != stSynSent || s.Outbound != 1 {
				t.Errorf("entry %+v, want SYN_SENT, opened by the sender", s)
			}
			for _, st := range []struct {
				reply bool
				flags byte
				gone  bool
			}{
				{true, tctest.SYN | tctest.ACK, false}, {false, tctest.ACK, false}, {true, tctest.ACK | tctest.PSH, false},
				{false, tctest.FIN | tctest.ACK, false}, {true, tctest.FIN | tctest.ACK, false}, {false, tctest.ACK, true},
			} {
				ret, _ := tctest.Run(t, c.objs.FromContainer, localTCP(st.reply, st.flags))
				if ret != tcActRedir {
					t.Fatalf("segment %+v: ret %d, want the table", st, ret)
				}
				if gone := c.objs.SkcFlows.Lookup(key, &s) != nil; gone != st.gone {
					t.Fatalf("after segment %+v: entry gone %v, want %v", st, gone, st.gone)
				}
			}
		})
	}
}

// Datagrams and echoes of a UDP flow and an ICMP echo flow between the
// local container and the remote one, as from_container and
// from_underlay see them.
func egressL4(proto byte, l4 []byte) []byte {
	return tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, proto, ipLocal, ipRemote, l4))
}

func ingressL4(proto byte, l4 []byte) []byte {
	inner := tctest.Eth(macVTEP, macPeerVTEP, 0x0800, tctest.IPv4(tctest.IPOpts{}, proto, ipRemote, ipLocal, l4))
	return tctest.VXLAN(tctest.IPOpts{}, macPeer, macUnderlay, ulPeer, ulLocal, testVNI, 4789, inner)
}

// TestPseudoConnections: UDP and ICMP echo flows open a table entry with
// their first packet, judged by the policy (and, inbound, by a socket of
// the container for UDP); replies go by the entry. Of ICMP, only the
// opener's requests and the other side's replies do.
func TestPseudoConnections(t *testing.T) {
	udpNS, closeNS := listenerNetns(t, unix.SOCK_DGRAM, 40000)
	defer closeNS()
	udpKey := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40000), Rport: ntohs(53), Proto: tctest.ProtoUDP}
	icmpKey := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(1), Rport: ntohs(1), Proto: tctest.ProtoICMP} // tctest.ICMP's identifier
	denyDNS, err := policy.NewSet([]policy.Rule{{ID: "dns", Action: policy.Deny, Dst: netip.PrefixFrom(ipRemote, 32), Proto: policy.UDP, Port: 53}})
	if err != nil {
		t.Fatal(err)
	}
	out := func(c *fastPath) *ebpf.Program { return c.objs.FromContainer }
	in := func(c *fastPath) *ebpf.Program { return c.objs.FromUnderlay }
	type step struct {
		prog  func(*fastPath) *ebpf.Program
		pkt   []byte
		fast  bool  // redirected by the table
		state uint8 // the entry's state after it (0: none)
	}
	udpOut, udpIn := egressL4(tctest.ProtoUDP, tctest.UDP(40000, 53, payload)), ingressL4(tctest.ProtoUDP, tctest.UDP(53, 40000, payload))
	for _, tc := range []struct {
		name  string
		set   policy.Set
		nsid  int32
		key   skcFlowKey
		steps []step
	}{
		{name: "UDP out, replied", nsid: -1, key: udpKey, steps: []step{{out, udpOut, true, stSynSent}, {in, udpIn, true, stEstablished}, {out, udpOut, true, stEstablished}}},
		{name: "UDP out, denied", set: denyDNS, nsid: -1, key: udpKey, steps: []step{{out, udpOut, false, 0}}},
		{name: "UDP in, to a socket", nsid: udpNS, key: udpKey, steps: []step{{in, udpIn, true, stSynRecv}, {out, udpOut, true, stEstablished}}},
		{name: "UDP in, no socket", nsid: -1, key: udpKey, steps: []step{{in, udpIn, false, 0}}},
		{name: "echo out, replied", nsid: -1, key: icmpKey, steps: []step{
			{out, egressL4(tctest.ProtoICMP, tctest.ICMP(8, payload)), true, stSynSent},
			{in, ingressL4(tctest.ProtoICMP, tctest.ICMP(0, payload)), true, stEstablished},
			// The other side's request is not the flow's: the overlay judges it.
			{in, ingressL4(tctest.ProtoICMP, tctest.ICMP(8, payload)), false, stEstablished},
			{out, egressL4(tctest.ProtoICMP, tctest.ICMP(0, payload)), false, stEstablished},
		}},
		{name: "echo reply opens nothing", nsid: -1, key: icmpKey, steps: []step{{out, egressL4(tctest.ProtoICMP, tctest.ICMP(0, payload)), false, 0}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			fill(t, c, false, true, true, true)
			localNetns(t, c, tc.nsid)
			judging(t, c, tc.set)
			for i, st := range tc.steps {
				var ret uint32
				d := delta(t, c, func() { ret, _ = tctest.Run(t, st.prog(c), st.pkt) })
				if fast := ret == tcActRedir; fast != st.fast {
					t.Fatalf("step %d: ret %d (counters %v), want the table's path: %v", i, ret, d, st.fast)
				}
				var s skcFlowState
				err := c.objs.SkcFlows.Lookup(tc.key, &s)
				switch {
				case st.state == 0 && err == nil:
					t.Fatalf("step %d: entry %+v, want none", i, s)
				case st.state != 0 && (err != nil || s.State != st.state):
					t.Fatalf("step %d: entry %+v (%v), want state %d", i, s, err, st.state)
				}
			}
		})
	}
}

// TestLocalDatagrams: UDP between two containers of this host goes by the
// table from its first datagram, judged as TCP is; a broadcast stays the
// bridge's.
func TestLocalDatagrams(t *testing.T) {
	nsid, closeNS := listenerNetns(t, unix.SOCK_DGRAM, 53)
	defer closeNS()
	deny, err := policy.NewSet([]policy.Rule{{ID: "dns", Action: policy.Deny, Dst: netip.PrefixFrom(ipLocal2, 32), Proto: policy.UDP}})
	if err != nil {
		t.Fatal(err)
	}
	datagram := func(src, dst netip.Addr, sport, dport uint16) []byte {
		return tctest.Eth(macContainer2, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, src, dst, tctest.UDP(sport, dport, payload)))
	}
	query, answer := datagram(ipLocal, ipLocal2, 40000, 53), datagram(ipLocal2, ipLocal, 53, 40000)
	for _, tc := range []struct {
		name    string
		set     policy.Set
		pkt     []byte
		reasons []string
		opened  bool
	}{
		{name: "allowed", pkt: query, reasons: []string{"from_container/local_table_open", "from_container/local_table_hit"}, opened: true},
		{name: "denied", set: deny, pkt: query, reasons: []string{"from_container/local_new_denied"}},
		{name: "broadcast", pkt: datagram(ipLocal, netip.MustParseAddr("10.244.1.255"), 40000, 53), reasons: []string{"from_container/local_pass"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			twoLocal(t, c, nsid)
			if err := c.SyncPolicy(tc.set, []netip.Addr{ipLocal, ipLocal2}); err != nil {
				t.Fatal(err)
			}
			var ret uint32
			d := delta(t, c, func() { ret, _ = tctest.Run(t, c.objs.FromContainer, tc.pkt) })
			expectCount(t, d, tc.reasons...)
			key := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipLocal2), Lport: ntohs(40000), Rport: ntohs(53), Proto: tctest.ProtoUDP}
			var s skcFlowState
			if opened := c.objs.SkcFlows.Lookup(key, &s) == nil; opened != tc.opened || (ret == tcActRedir) != tc.opened {
				t.Fatalf("ret %d, opened %v, want %v", ret, opened, tc.opened)
			}
			if !tc.opened {
				return
			}
			if ret, _ := tctest.Run(t, c.objs.FromContainer, answer); ret != tcActRedir {
				t.Fatalf("the answer: ret %d, want the table", ret)
			}
			if err := c.objs.SkcFlows.Lookup(key, &s); err != nil || s.State != stEstablished {
				t.Errorf("entry %+v (%v), want replied", s, err)
			}
		})
	}
}

// TestTrackedDatagram: a datagram of a UDP flow the host's conntrack holds
// (here, the reply direction of one the remote began: as a NATed flow's
// reply looks) opens nothing in the table, on either program; it leaves
// as the overlay sends it.
func TestTrackedDatagram(t *testing.T) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		// The thread enters a namespace of its own and is never reused:
		// the test's conntrack entry and program runs stay there.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			t.Error(err)
			return
		}
		remote := netlink.IPTuple{SrcIP: ipRemote.AsSlice(), DstIP: ipLocal.AsSlice(), SrcPort: 53, DstPort: 40000, Protocol: unix.IPPROTO_UDP}
		reply := netlink.IPTuple{SrcIP: ipLocal.AsSlice(), DstIP: ipRemote.AsSlice(), SrcPort: 40000, DstPort: 53, Protocol: unix.IPPROTO_UDP}
		if err := netlink.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, &netlink.ConntrackFlow{FamilyType: unix.AF_INET, Forward: remote, Reverse: reply, TimeOut: 60}); err != nil {
			t.Errorf("conntrack entry: %v", err)
			return
		}
		udpKey := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40000), Rport: ntohs(53), Proto: tctest.ProtoUDP}
		for _, tc := range []struct {
			name   string
			prog   func(*fastPath) *ebpf.Program
			pkt    []byte
			reason string
		}{
			{"out", func(c *fastPath) *ebpf.Program { return c.objs.FromContainer }, egressL4(tctest.ProtoUDP, tctest.UDP(40000, 53, payload)), "from_container/new_tracked"},
			{"in", func(c *fastPath) *ebpf.Program { return c.objs.FromUnderlay }, ingressL4(tctest.ProtoUDP, tctest.UDP(53, 40000, payload)), "from_underlay/new_tracked"},
		} {
			c := newTestCache(t, Capacity{})
			fill(t, c, false, true, true, true)
			var ep skcIngressEp
			if err := c.objs.SkcIngress.Lookup(be32(ipLocal), &ep); err != nil {
				t.Error(err)
				return
			}
			sock, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Error(err)
				return
			}
			defer unix.Close(sock)
			if tc.name == "in" {
				// The container's socket, in this namespace.
				if err := unix.Bind(sock, &unix.SockaddrInet4{Port: 40000}); err != nil {
					t.Error(err)
					return
				}
				ns, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
				if err != nil {
					t.Error(err)
					return
				}
				defer unix.Close(ns)
				if ep.NetnsId, err = netnsID(ns); err != nil {
					t.Error(err)
					return
				}
				if err := c.objs.SkcIngress.Put(be32(ipLocal), ep); err != nil {
					t.Error(err)
					return
				}
			}
			judging(t, c, nil)
			var ret uint32
			d := delta(t, c, func() { ret, _ = tctest.Run(t, tc.prog(c), tc.pkt) })
			if d[tc.reason] != 1 || ret == tcActRedir {
				t.Errorf("%s: ret %d, counters %v: want %s and the overlay", tc.name, ret, d, tc.reason)
			}
			var s skcFlowState
			if c.objs.SkcFlows.Lookup(udpKey, &s) == nil {
				t.Errorf("%s: entry %+v opened for a tracked flow", tc.name, s)
			}
		}
	}()
	<-done
}
