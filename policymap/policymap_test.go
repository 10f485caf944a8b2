package policymap

import (
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/tc/tctest"
)

// randomSet makes n rules over a small space of addresses, so that
// prefixes nest and overlap, with every kind of match and both actions.
func randomSet(t *testing.T, rng *rand.Rand, n int) policy.Set {
	t.Helper()
	prefix := func() netip.Prefix {
		if rng.IntN(4) == 0 {
			return netip.Prefix{}
		}
		a := netip.AddrFrom4([4]byte{10, 244, byte(rng.IntN(3)), byte(rng.IntN(8))})
		return netip.PrefixFrom(a, []int{8, 16, 23, 24, 30, 32}[rng.IntN(6)]).Masked()
	}
	var rules []policy.Rule
	for i := range n {
		r := policy.Rule{ID: fmt.Sprintf("r%d", i), Priority: rng.IntN(20), Action: []policy.Action{policy.Allow, policy.Deny}[rng.IntN(2)],
			Src: prefix(), Dst: prefix()}
		switch rng.IntN(5) {
		case 0:
			r.Proto = policy.ICMP
		case 1, 2:
			r.Proto = []string{policy.TCP, policy.UDP}[rng.IntN(2)]
			if rng.IntN(2) == 0 {
				r.Port = uint16(80 + rng.IntN(3))
				if rng.IntN(3) == 0 {
					r.PortEnd = r.Port + uint16(1+rng.IntN(2)) // a range
				}
			}
		}
		rules = append(rules, r)
	}
	set, err := policy.NewSet(rules)
	if err != nil {
		t.Fatal(err)
	}
	return set
}

var protoNames = map[uint8]string{6: policy.TCP, 17: policy.UDP, 1: policy.ICMP, 47: "gre"}

// flows yields every combination of a small space of addresses,
// protocols and ports.
func flows(yield func(a, b netip.Addr, proto uint8, port uint16) bool) {
	var addrs []netip.Addr
	for _, c := range []byte{0, 1, 2} {
		for _, d := range []byte{0, 1, 2, 3, 5, 7, 200} {
			addrs = append(addrs, netip.AddrFrom4([4]byte{10, 244, c, d}))
		}
	}
	addrs = append(addrs, netip.MustParseAddr("192.0.2.1"))
	for _, a := range addrs {
		for _, b := range addrs {
			for _, proto := range []uint8{6, 17, 1, 47} {
				ports := []uint16{0}
				if proto == 6 || proto == 17 {
					ports = []uint16{79, 80, 81, 82, 83, 84, 443}
				}
				for _, port := range ports {
					if !yield(a, b, proto, port) {
						return
					}
				}
			}
		}
	}
}

func want(set policy.Set, src, dst netip.Addr, proto uint8, port uint16) uint8 {
	if set.Allowed(policy.Flow{Src: src, Dst: dst, Proto: protoNames[proto], Port: port}) {
		return Allow
	}
	return Deny
}

// TestCompile: for random rule sets, the compiled maps give every flow the
// verdict the rule set does (policy.Set.Allowed, the model SKIFF-POLICY
// renders), from both ends; a container not compiled gets Unknown; tables
// are shared, and ids of tables that stay are kept.
func TestCompile(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	local := []netip.Addr{netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("10.244.1.3"), netip.MustParseAddr("10.244.1.200")}
	for round := range 40 {
		set := randomSet(t, rng, 1+rng.IntN(30))
		ids := map[string]uint32{}
		e := Compile(set, local, ids)
		bad := 0
		flows(func(a, b netip.Addr, proto uint8, port uint16) bool {
			for _, l := range local {
				if a == l {
					if got, w := e.Verdict(Egress, l, b, proto, port), want(set, a, b, proto, port); got != w {
						bad++
						t.Errorf("round %d, egress %s→%s %d/%d: %d, want %d\n%v", round, a, b, proto, port, got, w, set)
					}
				}
				if b == l {
					if got, w := e.Verdict(Ingress, l, a, proto, port), want(set, a, b, proto, port); got != w {
						bad++
						t.Errorf("round %d, ingress %s→%s %d/%d: %d, want %d\n%v", round, a, b, proto, port, got, w, set)
					}
				}
			}
			return bad < 5
		})
		if v := e.Verdict(Egress, netip.MustParseAddr("10.244.1.9"), local[0], 6, 80); v != Unknown {
			t.Errorf("a container not compiled: %d", v)
		}
		again := Compile(set, local, ids)
		for k, id := range e.Egress {
			if again.Egress[k] != id {
				t.Fatalf("recompiling moved %s from node %d to %d", k, id, again.Egress[k])
			}
		}
	}
	// A range is a cell per port, up to MaxPortCells; past that the
	// containers the rule applies to are not compiled (the overlay judges).
	wide := func(last uint16) policy.Set {
		set, err := policy.NewSet([]policy.Rule{
			{ID: "range", Action: policy.Deny, Dst: netip.MustParsePrefix("10.244.1.2/32"), Proto: policy.TCP, Port: 1000, PortEnd: last}})
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	e := Compile(wide(1000+MaxPortCells-1), local, map[string]uint32{})
	for _, port := range []uint16{1000, 1000 + MaxPortCells - 1} {
		if v := e.Verdict(Ingress, local[0], local[1], 6, port); v != Deny {
			t.Errorf("range at the bound, port %d: %d, want deny", port, v)
		}
	}
	if v := e.Verdict(Ingress, local[0], local[1], 6, 1000+MaxPortCells); v != Allow {
		t.Errorf("past the range: %d, want allow", v)
	}
	e = Compile(wide(1000+MaxPortCells), local, map[string]uint32{})
	if v := e.Verdict(Ingress, local[0], local[1], 6, 1000); v != Unknown {
		t.Errorf("range past the bound: %d, want unknown", v)
	}
	if v := e.Verdict(Egress, local[1], local[0], 6, 1000); v != Unknown { // the rule has any source
		t.Errorf("range past the bound, egress: %d, want unknown", v)
	}
	if v := e.Verdict(Ingress, local[1], local[0], 6, 1000); v != Allow {
		t.Errorf("a container the range does not apply to: %d, want allow", v)
	}
	// Nodes with one table share an id: no rule, one node for everything.
	e = Compile(nil, local, map[string]uint32{})
	if len(e.Verdicts) != 4 || len(e.Egress) != len(local) {
		t.Errorf("no rules: %d verdicts, %d prefixes; want 4 and %d", len(e.Verdicts), len(e.Egress), len(local))
	}
}

// TestVerdictProgram: policymap.h in a program (BPF_PROG_RUN) gives every
// packet of the flow matrix the rule set's verdict, from both ends, after
// the maps are synced and again after the rule set changes; malformed
// packets are not judged.
var testMAC = net.HardwareAddr{2, 0, 0, 0, 0, 1}

// packet is a flow's first packet: a SYN, a datagram, an echo request or
// a GRE packet.
func packet(src, dst netip.Addr, proto uint8, port uint16) []byte {
	var l4 []byte
	switch proto {
	case 6:
		l4 = tctest.TCP(40000, port, 0x02, nil)
	case 17:
		l4 = tctest.UDP(40000, port, []byte("x"))
	case 1:
		l4 = tctest.ICMP(8, []byte("ping"))
	default:
		l4 = []byte("gre payload.")
	}
	return tctest.Eth(testMAC, testMAC, 0x0800, tctest.IPv4(tctest.IPOpts{}, proto, src, dst, l4))
}

func TestVerdictProgram(t *testing.T) {
	var objs skpTestObjects
	if err := loadSkpTestObjects(&objs, nil); err != nil {
		t.Fatal(err)
	}
	defer objs.Close()
	m := &Maps{Egress: objs.SkpEgress, Ingress: objs.SkpIngress, Verdicts: objs.SkpVerdicts}
	local := []netip.Addr{netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("10.244.1.3")}
	rng := rand.New(rand.NewPCG(3, 4))
	for round := range 3 {
		set := randomSet(t, rng, 25)
		if err := m.Sync(set, local); err != nil {
			t.Fatal(err)
		}
		bad := 0
		flows(func(a, b netip.Addr, proto uint8, port uint16) bool {
			for dir, prog := range map[Direction]*ebpfProgram{Egress: objs.SkpTestEgress, Ingress: objs.SkpTestIngress} {
				if l := map[Direction]netip.Addr{Egress: a, Ingress: b}[dir]; l != local[0] && l != local[1] {
					continue
				}
				got, _ := tctest.Run(t, prog, packet(a, b, proto, port))
				if w := want(set, a, b, proto, port); got != uint32(w) {
					bad++
					t.Errorf("round %d, dir %d, %s→%s %d/%d: %d, want %d", round, dir, a, b, proto, port, got, w)
				}
			}
			return bad < 5
		})
		n, _ := mapLen(objs.SkpVerdicts)
		if want := len(m.have.Verdicts); n != want {
			t.Errorf("round %d: %d verdicts in the map, %d compiled", round, n, want)
		}
	}
	// A UDP header cut short, and not IPv4: not judged.
	short := packet(local[0], local[1], 17, 80)
	short = short[:len(short)-5]
	for name, p := range map[string][]byte{"short UDP": short, "IPv6": tctest.Eth(testMAC, testMAC, 0x86dd, make([]byte, 40))} {
		if got, _ := tctest.Run(t, objs.SkpTestEgress, p); got != 99 {
			t.Errorf("%s: %d, want 99 (not judged)", name, got)
		}
	}
	// A container not compiled: the overlay judges.
	if got, _ := tctest.Run(t, objs.SkpTestEgress, packet(netip.MustParseAddr("10.244.1.77"), local[0], 6, 80)); got != Unknown {
		t.Errorf("a container not compiled: %d, want %d", got, Unknown)
	}
}

type ebpfProgram = ebpf.Program

func mapLen(m *ebpf.Map) (int, error) {
	n := 0
	var k vkey
	var v uint8
	it := m.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	return n, it.Err()
}

// BenchmarkCompile: 10 000 random rules for 100 local containers
// (go test -bench Compile ./policymap): compile time and the entries.
func BenchmarkCompile(b *testing.B) {
	t := &testing.T{}
	set := randomSet(t, rand.New(rand.NewPCG(5, 6)), 10000)
	var local []netip.Addr
	for i := range 100 {
		local = append(local, netip.AddrFrom4([4]byte{10, 244, 1, byte(i + 2)}))
	}
	var e Entries
	for b.Loop() {
		e = Compile(set, local, map[string]uint32{})
	}
	b.ReportMetric(float64(len(e.Egress)+len(e.Ingress)), "prefixes")
	b.ReportMetric(float64(len(e.Verdicts)), "verdicts")
}

// BenchmarkCompileOne: one container's share of BenchmarkCompile's rules,
// what a container's ADD costs.
func BenchmarkCompileOne(b *testing.B) {
	t := &testing.T{}
	set := randomSet(t, rand.New(rand.NewPCG(5, 6)), 10000)
	local := []netip.Addr{netip.AddrFrom4([4]byte{10, 244, 1, 2})}
	for b.Loop() {
		Compile(set, local, map[string]uint32{})
	}
}

// BenchmarkCompileDistinct: 10 000 rules, each on a /32 source of its
// own (skiff bench --scale's), for three local containers: 10 001 nodes a
// direction. 1.9 s a compile before the rules were indexed by prefix
// (byOther), 85 ms after.
func BenchmarkCompileDistinct(b *testing.B) {
	var rules []policy.Rule
	for i := range 10000 {
		src := netip.AddrFrom4([4]byte{10, 244, byte(200 + i/256%50), byte(i % 256)})
		rules = append(rules, policy.Rule{ID: fmt.Sprintf("r%d", i), Priority: 1000 + i, Action: policy.Deny,
			Src: netip.PrefixFrom(src, 32), Proto: policy.TCP, Port: uint16(1 + i%60000)})
	}
	set, err := policy.NewSet(rules)
	if err != nil {
		b.Fatal(err)
	}
	local := []netip.Addr{netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("10.244.1.3"), netip.MustParseAddr("10.244.1.4")}
	for b.Loop() {
		Compile(set, local, map[string]uint32{})
	}
}

// TestAddRemove: a container added to synced maps (its share of the rules
// only) is judged as a full sync would judge it, the others as before;
// removed, it is not judged at all; a full sync afterwards keeps every
// verdict right (the ids Add gave stay unique).
func TestAddRemove(t *testing.T) {
	var objs skpTestObjects
	if err := loadSkpTestObjects(&objs, nil); err != nil {
		t.Fatal(err)
	}
	defer objs.Close()
	m := &Maps{Egress: objs.SkpEgress, Ingress: objs.SkpIngress, Verdicts: objs.SkpVerdicts}
	a, b := netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("10.244.1.3")
	judged := func(src, dst netip.Addr, proto uint8, port uint16, dir Direction) uint32 {
		prog := objs.SkpTestEgress
		if dir == Ingress {
			prog = objs.SkpTestIngress
		}
		got, _ := tctest.Run(t, prog, packet(src, dst, proto, port))
		return got
	}
	// check compares every flow of the matrix with local containers on
	// either end against the rules (or Unknown for containers not in on).
	check := func(step string, set policy.Set, on ...netip.Addr) {
		t.Helper()
		bad := 0
		flows(func(x, y netip.Addr, proto uint8, port uint16) bool {
			for dir, l := range map[Direction]netip.Addr{Egress: x, Ingress: y} {
				if l != a && l != b {
					continue
				}
				w := uint32(Unknown)
				if slices.Contains(on, l) {
					w = uint32(want(set, x, y, proto, port))
				}
				if got := judged(x, y, proto, port, dir); got != w {
					bad++
					t.Errorf("%s: dir %d, %s→%s %d/%d: %d, want %d", step, dir, x, y, proto, port, got, w)
				}
			}
			return bad < 5
		})
	}
	rng := rand.New(rand.NewPCG(7, 8))
	for round := range 3 {
		set := randomSet(t, rng, 25)
		if err := m.Sync(set, []netip.Addr{a}); err != nil {
			t.Fatal(err)
		}
		if err := m.Add(set, b); err != nil {
			t.Fatal(err)
		}
		check(fmt.Sprintf("round %d, added", round), set, a, b)
		if err := m.Remove(b); err != nil {
			t.Fatal(err)
		}
		check(fmt.Sprintf("round %d, removed", round), set, a)
		if err := m.Add(set, b); err != nil {
			t.Fatal(err)
		}
		if err := m.Sync(set, []netip.Addr{a, b}); err != nil {
			t.Fatal(err)
		}
		check(fmt.Sprintf("round %d, synced", round), set, a, b)
	}
}
