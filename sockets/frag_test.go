package sockets

import (
	"bytes"
	"fmt"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/tc/tctest"
)

// Golden-packet tests of what a sender with CAP_NET_RAW can make of the
// option SYN: fragments, split and cut-short headers, bad data offsets.
// Only a whole, well-formed SYN is recorded, and a container's TCP that
// could carry the option past its veth's check is dropped there.

// fragment is bytes [off, off+len(part)) of an IP payload as a frame: an
// IPv4 fragment (more: MF set) of ID 77.
func fragment(src, dst netip.Addr, proto byte, part []byte, off int, more bool) []byte {
	f := uint16(off / 8)
	if more {
		f |= 0x2000
	}
	return tctest.Eth(macB, macA, 0x0800, tctest.IPv4(tctest.IPOpts{Frag: f, ID: 77}, proto, src, dst, part))
}

// withDoff returns a copy of a frame (IPv4 without options, TCP) with the
// TCP data offset set to doff.
func withDoff(frame []byte, doff byte) []byte {
	out := append([]byte{}, frame...)
	out[14+20+12] = doff<<4 | out[14+20+12]&0x0f
	return out
}

// cutByIP returns a frame whose IP length ends keep bytes into the TCP
// segment, the rest of the segment left behind it as trailing bytes (an
// Ethernet pad, or a raw sender's), which the stack cuts off.
func cutByIP(src, dst netip.Addr, seg []byte, keep int) []byte {
	frame := tctest.Eth(macB, macA, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, src, dst, seg[:keep]))
	return append(frame, seg[keep:]...)
}

// fragCase is a frame, what a program must answer, and the counter it must
// raise by one ("" for none).
type fragCase struct {
	name    string
	pkt     []byte
	verdict uint32
	reason  string
}

// shapes returns the ways a sender from src to dst can cut up or bend an
// option SYN (header 56 bytes, 96 bytes of data): the frames, and for each
// whether the recorder (underlay) and from_container must drop it and
// count it under a reason.
func shapes(src, dst netip.Addr, option []byte) (underlay, container []fragCase) {
	const shot = 2
	opts := append(append([]byte{}, linuxSYNOptions...), option...)
	seg := tctest.TCPWithOptions(40000, 8080, tctest.SYN, opts, make([]byte, 96))
	bare := tctest.TCPWithOptions(40000, 8080, tctest.SYN, opts, nil)
	ack := tctest.TCPWithOptions(40000, 8080, tctest.ACK, nil, make([]byte, 96))
	udp := tctest.UDP(40000, 8080, make([]byte, 96))
	whole := func(seg []byte) []byte {
		return tctest.Eth(macB, macA, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, src, dst, seg))
	}
	tiny := fragment(src, dst, tctest.ProtoTCP, seg[:8], 0, true)
	// Padded to Ethernet's 60 bytes with what follows in the segment:
	// the flags and option are there by data_end, not by the IP length.
	tinyPadded := append(append([]byte{}, tiny...), seg[8:26]...)
	type shape struct {
		name                string
		pkt                 []byte
		underlay, container fragCase
	}
	drop := func(reason string) fragCase { return fragCase{verdict: shot, reason: reason} }
	pass := func(v uint32) fragCase { return fragCase{verdict: v} }
	for _, s := range []shape{
		{"first fragment with the whole option SYN and MF", fragment(src, dst, tctest.ProtoTCP, seg[:64], 0, true), drop("tcp_fragment"), drop("tcp_fragment")},
		{"option SYN without data, MF set", fragment(src, dst, tctest.ProtoTCP, bare, 0, true), drop("tcp_fragment"), drop("tcp_fragment")},
		{"tiny first fragment (8 bytes of TCP)", tiny, drop("tcp_fragment"), drop("tcp_fragment")},
		{"tiny first fragment, padded", tinyPadded, drop("tcp_fragment"), drop("tcp_fragment")},
		{"TCP header split (16 bytes in the first fragment)", fragment(src, dst, tctest.ProtoTCP, seg[:16], 0, true), drop("tcp_fragment"), drop("tcp_fragment")},
		// A later fragment's bytes are no header, whatever they look like.
		{"middle fragment shaped as an option SYN", fragment(src, dst, tctest.ProtoTCP, seg, 24, true), pass(next), drop("tcp_fragment")},
		{"last fragment shaped as an option SYN (offset ≠ 0)", fragment(src, dst, tctest.ProtoTCP, seg, 24, false), pass(next), drop("tcp_fragment")},
		{"last fragment of the option SYN", fragment(src, dst, tctest.ProtoTCP, seg[64:], 64, false), pass(next), drop("tcp_fragment")},
		// A host's fragmented data is the host's; a container's TCP is
		// never fragmented by its own stack (DF, segments sized to the MTU).
		{"first fragment of an ACK with data", fragment(src, dst, tctest.ProtoTCP, ack[:64], 0, true), pass(next), drop("tcp_fragment")},
		{"UDP first fragment", fragment(src, dst, tctest.ProtoUDP, udp[:64], 0, true), pass(next), pass(next)},
		{"UDP middle fragment", fragment(src, dst, tctest.ProtoUDP, udp[8:64], 64, true), pass(next), pass(next)},
		{"UDP last fragment", fragment(src, dst, tctest.ProtoUDP, udp[64:], 64, false), pass(next), pass(next)},
		{"ICMP fragment", fragment(src, dst, 1, tctest.ICMP(8, make([]byte, 64)), 0, true), pass(next), pass(next)},
		// Whole but malformed: nothing the stack would take as the SYN.
		{"data offset 3", withDoff(whole(bare), 3), pass(next), drop("tcp_malformed")},
		{"data offset past the packet", withDoff(whole(bare), 15), pass(next), drop("tcp_malformed")},
		{"option area cut short", whole(bare[:40]), pass(next), drop("tcp_malformed")},
		{"option past the IP length", cutByIP(src, dst, bare, 40), pass(next), drop("tcp_malformed")},
		{"TCP header cut short", whole(bare[:12]), pass(next), drop("tcp_malformed")},
		{"TCP header cut short by the IP length", cutByIP(src, dst, bare, 12), pass(next), drop("tcp_malformed")},
		// Other segments with a bad offset are the stack's to drop: nothing
		// records them.
		{"ACK with data offset 3", withDoff(whole(ack), 3), pass(next), pass(next)},
		{"plain SYN", whole(tctest.TCPWithOptions(40000, 8080, tctest.SYN, linuxSYNOptions, nil)), pass(next), pass(next)},
	} {
		s.underlay.name, s.underlay.pkt = s.name, s.pkt
		s.container.name, s.container.pkt = s.name, s.pkt
		underlay = append(underlay, s.underlay)
		container = append(container, s.container)
	}
	return underlay, container
}

// runCases runs prog on each case: the verdict, the packet left untouched
// and the counter.
func runCases(t *testing.T, l *dataPlane, prog string, cases []fragCase, check func(t *testing.T, c fragCase)) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before, _ := l.Stats()
			verdict, out := tctest.Run(t, progByName(l, prog), c.pkt)
			if verdict != c.verdict {
				t.Errorf("verdict %d, want %d", int32(verdict), int32(c.verdict))
			}
			if !bytes.Equal(out[:len(c.pkt)], c.pkt) {
				t.Errorf("packet\n%x\nwant\n%x", out[:len(c.pkt)], c.pkt)
			}
			after, _ := l.Stats()
			for _, r := range []string{"tcp_fragment", "tcp_malformed", "syn_forged", "syn_recorded"} {
				want := before[r]
				if r == c.reason {
					want++
				}
				if after[r] != want {
					t.Errorf("%s %d → %d, want %d", r, before[r], after[r], want)
				}
			}
			if check != nil {
				check(t, c)
			}
		})
	}
}

func progByName(l *dataPlane, name string) *ebpf.Program {
	switch name {
	case "from_underlay":
		return l.objs.SksFromUnderlay
	case "from_container":
		return l.objs.SksFromContainer
	}
	panic(fmt.Sprintf("no program %s", name))
}

// The recorder takes only a whole SYN: no fragment is recorded, a first
// fragment that is a SYN (or too short to tell) is dropped, later ones
// pass unread; a SYN whose header does not end inside the IP length is
// not recorded. A well-formed option SYN still is.
func TestFromUnderlayFragments(t *testing.T) {
	l := loadTest(t)
	withPeer(t, l)
	server := netip.AddrPortFrom(ipServer, 8080)
	cases, _ := shapes(ulPeer, testHost.UnderlayIP, synOption(server, ipClient))
	good := append(append([]byte{}, linuxSYNOptions...), synOption(server, ipClient)...)
	cases = append(cases, fragCase{"well-formed option SYN", syn(ulPeer, testHost.UnderlayIP, tctest.SYN, good), ^uint32(0), "syn_recorded"})
	tuple := sksSksTuple{Saddr: bpfmap.IPv4(ulPeer), Daddr: bpfmap.IPv4(testHost.UnderlayIP), Sport: bpfmap.Port(40000), Dport: bpfmap.Port(8080)}
	runCases(t, l, "from_underlay", cases, func(t *testing.T, c fragCase) {
		_, recorded := pendingEntry(t, l, ulPeer, testHost.UnderlayIP)
		if recorded != (c.reason == "syn_recorded") {
			t.Errorf("recorded=%v", recorded)
		}
		l.objs.SksSyns.Delete(tuple)
	})
}

// A container's TCP that could carry the option past its veth is dropped:
// every TCP fragment, a cut-short header, a SYN with a bad data offset.
// Its other fragments (UDP, ICMP) and well-formed segments pass untouched.
func TestFromContainerFragments(t *testing.T) {
	l := loadTest(t)
	_, cases := shapes(ipServer, ulPeer, synOption(netip.AddrPortFrom(ipClient, 8080), ipServer))
	runCases(t, l, "from_container", cases, nil)
}

// The server's host judges a recorded SYN by its own policy before it
// steers it: a deny rule holds even when the client's host was bypassed.
func TestLookupJudgesRecordedSYN(t *testing.T) {
	l := loadTest(t)
	ln, cookie := listener(t)
	server := netip.AddrPortFrom(ipServer, 8080)
	publish(t, l, ln, server)
	client := netip.AddrPortFrom(ulPeer, 40000)
	host := netip.AddrPortFrom(testHost.UnderlayIP, 8080)
	hosts := []cluster.Host{testHost, {Name: "h2", UnderlayIP: ulPeer, Subnet: subnetB}}
	pfx := netip.MustParsePrefix
	deny := policy.Rule{ID: "deny", Priority: 5, Action: policy.Deny, Src: pfx(ipClient.String() + "/32"),
		Dst: pfx(ipServer.String() + "/32"), Proto: policy.TCP, Port: 8080}
	allowFirst := policy.Rule{ID: "allow", Priority: 1, Action: policy.Allow, Src: pfx("10.244.2.0/24")}
	otherPort := deny
	otherPort.ID, otherPort.Port = "other-port", 8081
	otherSrc := deny
	otherSrc.ID, otherSrc.Src = "other-src", pfx("10.244.2.8/32")
	var tooMany []policy.Rule
	for i := range len(sksSksRules{}.Rules) + 1 {
		tooMany = append(tooMany, policy.Rule{ID: fmt.Sprintf("r%04d", i), Priority: 100, Action: policy.Deny, Proto: policy.TCP, Port: uint16(9000 + i)})
	}
	record := syn(ulPeer, testHost.UnderlayIP, tctest.SYN, append(append([]byte{}, linuxSYNOptions...), synOption(server, ipClient)...))
	for _, c := range []struct {
		name  string
		rules []policy.Rule
		steer bool
	}{
		{"no rules", nil, true},
		{"a rule denying the client", []policy.Rule{deny}, false},
		{"a rule for another port", []policy.Rule{otherPort}, true},
		{"a rule for another source", []policy.Rule{otherSrc}, true},
		{"an allow rule first", []policy.Rule{allowFirst, deny}, true},
		// As at connect4: with more rules than fit nothing is judged here,
		// and nothing is steered.
		{"more rules than fit", tooMany, false},
	} {
		set, err := policy.NewSet(c.rules)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Sync(hosts, nil, set); err != nil {
			t.Fatal(err)
		}
		tctest.Run(t, l.objs.SksFromUnderlay, record)
		before, _ := l.Stats()
		got, verdict := lookupVerdict(t, l, syscall.IPPROTO_TCP, client, host)
		after, _ := l.Stats()
		_, kept := pendingEntry(t, l, ulPeer, testHost.UnderlayIP)
		if c.steer {
			if got != cookie || verdict != 1 || !kept || after["assigned"] != before["assigned"]+1 {
				t.Errorf("%s: assigned to %d, verdict %d, record kept %v; want the listener", c.name, got, verdict, kept)
			}
		} else if got != 0 || verdict != 0 || kept || after["syn_denied"] != before["syn_denied"]+1 {
			// SK_DROP: the kernel answers with a RST; the record goes, a
			// retransmit is judged anew.
			t.Errorf("%s: assigned to %d, verdict %d, record kept %v, syn_denied +%d; want SK_DROP, record gone, +1",
				c.name, got, verdict, kept, after["syn_denied"]-before["syn_denied"])
		}
	}
	// An overlay SYN is not recorded: INPUT judges it (the mark), not sk_lookup.
	set, _ := policy.NewSet([]policy.Rule{deny})
	if err := l.Sync(hosts, nil, set); err != nil {
		t.Fatal(err)
	}
	if got := lookup(t, l, netip.AddrPortFrom(ipClient, 40000), server); got != cookie {
		t.Fatalf("overlay SYN assigned to %d, want %d", got, cookie)
	}
}

// BenchmarkLookup times sk_lookup on a recorded SYN (BPF_PROG_RUN, hot
// caches), which judges the policy: without rules, and with 100 rules that
// do not match (the loop reads every one).
func BenchmarkLookup(b *testing.B) {
	l := loadTestTB(b)
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer syscall.Close(fd)
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		b.Fatal(err)
	}
	if err := syscall.Listen(fd, 16); err != nil {
		b.Fatal(err)
	}
	server := netip.AddrPortFrom(ipServer, 8080)
	if err := l.objs.SksListen.Put(sksSksKey{Ip: bpfmap.IPv4(ipServer), Port: bpfmap.Port(8080)}, uint64(fd)); err != nil {
		b.Fatal(err)
	}
	hosts := []cluster.Host{testHost, {Name: "h2", UnderlayIP: ulPeer, Subnet: subnetB}}
	record := syn(ulPeer, testHost.UnderlayIP, tctest.SYN, append(append([]byte{}, linuxSYNOptions...), synOption(server, ipClient)...))
	var hundred []policy.Rule
	for i := range 100 {
		hundred = append(hundred, policy.Rule{ID: fmt.Sprintf("r%03d", i), Priority: 100, Action: policy.Deny, Proto: policy.TCP, Port: uint16(9000 + i)})
	}
	for _, c := range []struct {
		name  string
		rules []policy.Rule
	}{{"recorded SYN, no rules", nil}, {"recorded SYN, 100 rules", hundred}} {
		b.Run(c.name, func(b *testing.B) {
			set, err := policy.NewSet(c.rules)
			if err != nil {
				b.Fatal(err)
			}
			if err := l.Sync(hosts, nil, set); err != nil {
				b.Fatal(err)
			}
			if _, _, err := l.objs.SksFromUnderlay.Test(record); err != nil {
				b.Fatal(err)
			}
			in := skLookup{Family: syscall.AF_INET, Protocol: syscall.IPPROTO_TCP, RemoteIP4: ulPeer.As4(),
				RemotePort: bpfmap.Port(40000), LocalIP4: testHost.UnderlayIP.As4(), LocalPort: 8080}
			// The kernel runs it b.N times in one call (its timer is not
			// returned): the call's own cost is spread over them.
			start := time.Now()
			ret, err := l.objs.SksLookup.Run(&ebpf.RunOptions{Context: in, Repeat: uint32(b.N)})
			if err != nil {
				b.Fatal(err)
			}
			if ret != 1 {
				b.Fatalf("sk_lookup returned %d", ret)
			}
			b.ReportMetric(float64(time.Since(start).Nanoseconds())/float64(b.N), "ns/run")
		})
	}
}

// BenchmarkFromContainer times from_container (BPF_PROG_RUN, hot caches)
// on a container's segments to another host: data, and a plain SYN, whose
// header it checks in full.
func BenchmarkFromContainer(b *testing.B) {
	l := loadTestTB(b)
	for _, c := range []struct {
		name string
		pkt  []byte
	}{
		{"ACK with data", tctest.Eth(macB, macA, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, ipServer, ipClient,
			tctest.TCP(40000, 8080, tctest.ACK, make([]byte, 1000))))},
		{"plain SYN", syn(ipServer, ipClient, tctest.SYN, linuxSYNOptions)},
		{"UDP fragment", fragment(ipServer, ipClient, tctest.ProtoUDP, make([]byte, 1000), 0, true)},
	} {
		b.Run(c.name, func(b *testing.B) {
			_, per, err := l.objs.SksFromContainer.Benchmark(c.pkt, b.N, nil)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(per.Nanoseconds()), "ns/run")
		})
	}
}
