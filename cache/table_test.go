package cache

import (
	"bytes"
	"errors"
	"net"
	"net/netip"
	"runtime"
	"testing"

	"github.com/cilium/ebpf"
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
		{name: "denied", judge: true, set: deny80(t), paths: true, reasons: []string{"from_container/syn_denied"}},
		{name: "policy not compiled", paths: true, reasons: []string{"from_container/syn_unjudged"}},
		{name: "policy being changed", judge: true, paused: true, paths: true, reasons: []string{"from_container/syn_unjudged"}},
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
	nsid, closeNS := listenerNetns(t, 40000)
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
		{name: "no socket in the container", source: ulPeer, nsid: -1, reasons: []string{"from_underlay/syn_no_listener"}},
		{name: "denied", set: denyFrom(t), source: ulPeer, nsid: nsid, reasons: []string{"from_underlay/syn_denied"}},
		{name: "forged source", source: ulOther, nsid: nsid, reasons: []string{"from_underlay/pass_syn_fin_rst"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, Capacity{})
			fill(t, c, false, true, true, true)
			if err := c.objs.SkcEgressIp.Put(be32(ipRemote), be32(tc.source)); err != nil {
				t.Fatal(err)
			}
			var ep skcIngressEp
			if err := c.objs.SkcIngress.Lookup(be32(ipLocal), &ep); err != nil {
				t.Fatal(err)
			}
			ep.NetnsId = tc.nsid
			if err := c.objs.SkcIngress.Put(be32(ipLocal), ep); err != nil {
				t.Fatal(err)
			}
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

// denyFrom denies the remote container's TCP to the local one's port 40000.
func denyFrom(t *testing.T) policy.Set {
	set, err := policy.NewSet([]policy.Rule{{ID: "in", Action: policy.Deny, Src: netip.PrefixFrom(ipRemote, 32),
		Dst: netip.PrefixFrom(ipLocal, 32), Proto: policy.TCP, Port: 40000}})
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// listenerNetns makes a network namespace with a TCP listener on port and
// returns its id in the test's namespace.
func listenerNetns(t *testing.T, port int) (int32, func()) {
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
		if r.sock, r.err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); r.err != nil {
			return
		}
		if r.err = unix.Bind(r.sock, &unix.SockaddrInet4{Port: port}); r.err != nil {
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

// TestExpire: connections idle past their state's conntrack timeout end;
// others stay.
func TestExpire(t *testing.T) {
	c := newTestCache(t, Capacity{})
	now, err := monotonicCoarse()
	if err != nil {
		t.Fatal(err)
	}
	ago := func(s uint64) uint64 { return now - s*1_000_000_000 }
	lim := timeouts()
	synSent := uint64(lim[stSynSent].Seconds())
	keys := map[uint16]skcFlowState{
		1: {State: stSynSent, Seen: ago(synSent + 10)},     // never answered: ends
		2: {State: stSynSent, Seen: ago(1)},                // just sent: stays
		3: {State: stEstablished, Seen: ago(synSent + 10)}, // idle, but established: stays
		4: {State: 9, Seen: now},                           // no state the programs write: ends
	}
	for p, s := range keys {
		k := connKey
		k.Lport = p
		if err := c.objs.SkcFlows.Put(k, s); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := c.expire(); err != nil || n != 2 {
		t.Fatalf("expired %d (%v), want 2", n, err)
	}
	for _, p := range []uint16{2, 3} {
		k := connKey
		k.Lport = p
		var s skcFlowState
		if err := c.objs.SkcFlows.Lookup(k, &s); err != nil {
			t.Errorf("connection %d went: %v", p, err)
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
	nsid, closeNS := listenerNetns(t, 80)
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
		{name: "receiver's ingress denies", set: denyIn, nsid: nsid, pkt: localTCP(false, tctest.SYN), reasons: []string{"from_container/local_syn_denied"}},
		{name: "sender's egress denies", set: denyOut, nsid: nsid, pkt: localTCP(false, tctest.SYN), reasons: []string{"from_container/local_syn_denied"}},
		{name: "no socket in the receiver", nsid: -1, pkt: localTCP(false, tctest.SYN), reasons: []string{"from_container/local_syn_no_listener"}},
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
