package steering

import (
	"bytes"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/tc/tctest"
)

var (
	mac      = net.HardwareAddr{2, 0, 0, 0, 0, 1}
	ulLocal  = netip.MustParseAddr("10.99.0.1")
	ulPeer   = netip.MustParseAddr("10.99.0.2")
	ipRemote = netip.MustParseAddr("10.244.2.7")
	ipLocal  = netip.MustParseAddr("10.244.1.5")
)

const (
	testVNI  = 1
	loIndex  = 1 // BPF_PROG_RUN's skb is on the test namespace's lo
	tcUnspec = 0xffffffff
)

// loadTest loads the programs as the layer would, recording decisions,
// steering among CPUs 0 and 1 with threshold 80.
func loadTest(t *testing.T) *stxObjects {
	t.Helper()
	spec, err := loadStx()
	if err != nil {
		t.Fatal(err)
	}
	for name, v := range map[string]any{"cfg_vxlan_port": bpfmap.Port(4789), "cfg_vni": uint32(testVNI), "cfg_underlay_ip": bpfmap.IPv4(ulLocal), "cfg_record": uint32(1)} {
		if err := spec.Variables[name].Set(v); err != nil {
			t.Fatal(name, err)
		}
	}
	var objs stxObjects
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: bpffstest.Dir(t)}}); err != nil {
		t.Fatalf("%+v", err)
	}
	t.Cleanup(func() { objs.Close() })
	cfg := stxStxCfg{N: 2, Threshold: 80, StaleNs: uint64(200 * time.Millisecond)}
	cfg.Cpus[0], cfg.Cpus[1] = 0, 1
	if err := objs.StxConfig.Put(uint32(0), cfg); err != nil {
		t.Fatal(err)
	}
	return &objs
}

// configure changes the programs' configuration.
func configure(t *testing.T, objs *stxObjects, change func(*stxStxCfg)) {
	t.Helper()
	var cfg stxStxCfg
	if err := objs.StxConfig.Lookup(uint32(0), &cfg); err != nil {
		t.Fatal(err)
	}
	change(&cfg)
	if err := objs.StxConfig.Put(uint32(0), cfg); err != nil {
		t.Fatal(err)
	}
}

// onCPU0 runs the rest of the test on CPU 0: BPF_PROG_RUN runs the program
// on the calling CPU, which the pick avoids.
func onCPU0(t *testing.T) {
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	var set unix.CPUSet
	set.Set(0)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		t.Fatal(err)
	}
}

func setLoads(t *testing.T, objs *stxObjects, age time.Duration, cpu0, cpu1 uint32) {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	l := stxStxLoad{StampNs: uint64(ts.Nano() - age.Nanoseconds())}
	l.Pct[0], l.Pct[1] = cpu0, cpu1
	if err := objs.StxLoads.Put(uint32(0), l); err != nil {
		t.Fatal(err)
	}
}

// run runs prog on p and returns the decision it recorded (zero: none);
// the verdict must be TC_ACT_UNSPEC and the packet unchanged.
func run(t *testing.T, objs *stxObjects, prog *ebpf.Program, p []byte) stxStxLast {
	t.Helper()
	if err := objs.StxRecorded.Put(uint32(0), stxStxLast{}); err != nil {
		t.Fatal(err)
	}
	ret, out := tctest.Run(t, prog, p)
	if ret != tcUnspec || !bytes.Equal(out, p) {
		t.Errorf("%v: verdict %#x, packet changed %v; want TC_ACT_UNSPEC and the packet as it came", prog, ret, !bytes.Equal(out, p))
	}
	var last stxStxLast
	if err := objs.StxRecorded.Lookup(uint32(0), &last); err != nil {
		t.Fatal(err)
	}
	return last
}

func innerTCP(sport uint16, o tctest.IPOpts) []byte {
	return tctest.Eth(mac, mac, 0x0800, tctest.IPv4(o, tctest.ProtoTCP, ipRemote, ipLocal, tctest.TCP(sport, 80, tctest.ACK, []byte("steer"))))
}

func vxlan(inner []byte) []byte {
	return tctest.VXLAN(tctest.IPOpts{}, mac, mac, ulPeer, ulLocal, testVNI, 4789, inner)
}

func counters(t *testing.T, m *ebpf.Map, n int) []uint64 {
	t.Helper()
	c, err := bpfmap.Counters(m, n)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// portFor finds a source port whose flow's first choice, on a device with
// salt, is CPU index want.
func portFor(t *testing.T, want uint32) uint16 {
	for p := uint16(1000); p < 2000; p++ {
		f := Flow{Src: ipRemote, Dst: ipLocal, Proto: 6, Sport: p, Dport: 80}
		if firstChoice(f.hash(0), loIndex, 2) == want {
			return p
		}
	}
	t.Fatal("no port")
	return 0
}

// TestSteer: the hash each program writes sends the flow's next stage to
// the CPU the pick chose: the flow's first choice for the device; its
// second when the first is loaded and the second less so; the next CPU
// when the first is the one running the program; the first when loads are
// stale. stx_underlay judges the inner flow of the overlay's VXLAN
// packets; stx_to_container the container's frames.
func TestSteer(t *testing.T) {
	onCPU0(t)
	objs := loadTest(t)
	toCPU0, toCPU1 := portFor(t, 0), portFor(t, 1)
	for _, c := range []struct {
		name       string
		sport      uint16
		age        time.Duration
		cpu0, cpu1 uint32
		cpu        uint32
		reason     stxStxReason
	}{
		{"first choice", toCPU1, 0, 10, 10, 1, stxStxReasonSTX_FIRST},
		{"first choice loaded, second less", toCPU1, 0, 10, 90, 0, stxStxReasonSTX_SECOND},
		{"first choice loaded, second more", toCPU1, 0, 95, 90, 1, stxStxReasonSTX_FIRST},
		{"first choice this CPU", toCPU0, 0, 10, 10, 1, stxStxReasonSTX_SELF_AVOIDED},
		{"first choice this CPU and loaded", toCPU0, 0, 90, 10, 1, stxStxReasonSTX_SECOND},
		{"this CPU, the next loaded", toCPU0, 0, 10, 90, 0, stxStxReasonSTX_FIRST},
		{"stale loads", toCPU1, time.Second, 10, 90, 1, stxStxReasonSTX_FIRST},
		{"stale loads, this CPU", toCPU0, time.Second, 90, 90, 1, stxStxReasonSTX_SELF_AVOIDED},
	} {
		setLoads(t, objs, c.age, c.cpu0, c.cpu1)
		inner := innerTCP(c.sport, tctest.IPOpts{})
		flow := Flow{Src: ipRemote, Dst: ipLocal, Proto: 6, Sport: c.sport, Dport: 80}.hash(0)
		for _, p := range []struct {
			prog *ebpf.Program
			pkt  []byte
		}{{objs.StxUnderlay, vxlan(inner)}, {objs.StxToContainer, inner}} {
			got := run(t, objs, p.prog, p.pkt)
			if got.Flow != flow || got.Cpu != c.cpu || got.Reason != uint32(c.reason) || got.Hash != hashForIndex(got.Idx, 2, mix32(flow^loIndex)) || scale(got.Hash, 2) != c.cpu {
				t.Errorf("%s, %v: recorded %+v; want flow %#x to CPU %d (%v)", c.name, p.prog, got, flow, c.cpu, c.reason)
			}
		}
	}
	stale := counters(t, objs.StxStats, int(stxStxReasonSTX_NREASONS))[stxStxReasonSTX_STALE_LOAD]
	if stale != 4 {
		t.Errorf("%d stale-load decisions counted, want 4", stale)
	}
}

// TestUntouched: packets that are not the overlay's IPv4 (other UDP, a
// foreign VNI, IPv6, ARP, truncated headers) get no hash and are counted
// by reason; a fragment is steered by its addresses and protocol.
func TestUntouched(t *testing.T) {
	onCPU0(t)
	objs := loadTest(t)
	setLoads(t, objs, 0, 10, 10)
	inner := innerTCP(1234, tctest.IPOpts{})
	ipv6 := tctest.Eth(mac, mac, 0x86dd, make([]byte, 60))
	arp := tctest.Eth(mac, mac, 0x0806, make([]byte, 28))
	other := tctest.Eth(mac, mac, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, ulPeer, ulLocal, tctest.UDP(5000, 53, make([]byte, 40))))
	notMine := tctest.VXLAN(tctest.IPOpts{}, mac, mac, ulPeer, netip.MustParseAddr("10.99.0.3"), testVNI, 4789, inner)
	for _, c := range []struct {
		name   string
		prog   *ebpf.Program
		pkt    []byte
		reason stxStxReason
	}{
		{"UDP not VXLAN", objs.StxUnderlay, other, stxStxReasonSTX_NOT_VXLAN},
		{"another VNI", objs.StxUnderlay, tctest.VXLAN(tctest.IPOpts{}, mac, mac, ulPeer, ulLocal, 7, 4789, inner), stxStxReasonSTX_NOT_VXLAN},
		{"another port", objs.StxUnderlay, tctest.VXLAN(tctest.IPOpts{}, mac, mac, ulPeer, ulLocal, testVNI, 8472, inner), stxStxReasonSTX_NOT_VXLAN},
		{"another host's address", objs.StxUnderlay, notMine, stxStxReasonSTX_NOT_VXLAN},
		{"outer IPv6", objs.StxUnderlay, ipv6, stxStxReasonSTX_NOT_VXLAN},
		{"ARP", objs.StxUnderlay, arp, stxStxReasonSTX_NOT_VXLAN},
		{"inner IPv6", objs.StxUnderlay, vxlan(ipv6), stxStxReasonSTX_NOT_IPV4},
		{"inner truncated", objs.StxUnderlay, vxlan(inner[:14+12]), stxStxReasonSTX_MALFORMED},
		{"inner ports cut off", objs.StxUnderlay, vxlan(inner[:14+20+2]), stxStxReasonSTX_MALFORMED},
		{"container IPv6", objs.StxToContainer, ipv6, stxStxReasonSTX_NOT_IPV4},
		{"container ARP", objs.StxToContainer, arp, stxStxReasonSTX_NOT_IPV4},
		// (BPF_PROG_RUN refuses a truncated outer IPv4 header.)
		{"container ports cut off", objs.StxToContainer, inner[:14+20+2], stxStxReasonSTX_MALFORMED},
	} {
		before := counters(t, objs.StxStats, int(stxStxReasonSTX_NREASONS))
		if got := run(t, objs, c.prog, c.pkt); got != (stxStxLast{}) {
			t.Errorf("%s: steered %+v", c.name, got)
		}
		after := counters(t, objs.StxStats, int(stxStxReasonSTX_NREASONS))
		if after[c.reason]-before[c.reason] != 1 {
			t.Errorf("%s: counters %v then %v, want one %v", c.name, before, after, c.reason)
		}
	}
	frag := innerTCP(1234, tctest.IPOpts{Frag: 0x2000}) // MF
	flow := Flow{Src: ipRemote, Dst: ipLocal, Proto: 6, Fragment: true}.hash(0)
	before := counters(t, objs.StxStats, int(stxStxReasonSTX_NREASONS))
	if got := run(t, objs, objs.StxUnderlay, vxlan(frag)); got.Flow != flow || got.Hash == 0 {
		t.Errorf("inner fragment: recorded %+v, want flow %#x (no ports)", got, flow)
	}
	if after := counters(t, objs.StxStats, int(stxStxReasonSTX_NREASONS)); after[stxStxReasonSTX_FRAGMENT]-before[stxStxReasonSTX_FRAGMENT] != 1 {
		t.Errorf("fragment not counted: %v then %v", before, after)
	}
}

// TestStages: each stage's program counts the packets of its stage on the
// CPU that ran it, stx_underlay only the overlay's.
func TestStages(t *testing.T) {
	onCPU0(t)
	objs := loadTest(t)
	inner := innerTCP(1234, tctest.IPOpts{})
	other := tctest.Eth(mac, mac, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, ulPeer, ulLocal, tctest.UDP(5000, 53, nil)))
	run(t, objs, objs.StxUnderlay, vxlan(inner))
	run(t, objs, objs.StxUnderlay, other)
	run(t, objs, objs.StxVxlan, inner)
	run(t, objs, objs.StxVxlan, inner)
	run(t, objs, objs.StxContainer, inner)
	var per []uint64
	for stage, want := range []uint64{1, 2, 1} {
		if err := objs.StxStages.Lookup(uint32(stage), &per); err != nil {
			t.Fatal(err)
		}
		if per[0] != want {
			t.Errorf("stage %d: %v per CPU, want %d on CPU 0", stage, per, want)
		}
	}
}

// TestLightFlows: a flow that has not carried heavy_bytes in its window
// keeps its next stage on the CPU running the program (hash 0: RPS picks
// no CPU, so no hand-over and no backlog pass);
// once it has, it is steered; each flow is judged on its own.
func TestLightFlows(t *testing.T) {
	onCPU0(t)
	objs := loadTest(t)
	configure(t, objs, func(c *stxStxCfg) { c.HeavyBytes, c.WindowNs = 4000, uint32(time.Second) })
	setLoads(t, objs, 0, 10, 10)
	inner := innerTCP(portFor(t, 1), tctest.IPOpts{})
	pkt := vxlan(inner)
	sent := 0
	for sent+len(pkt) < 4000 {
		if got := run(t, objs, objs.StxUnderlay, pkt); got.Reason != uint32(stxStxReasonSTX_LIGHT) || got.Cpu != 0 || got.Hash != 0 {
			t.Fatalf("after %d bytes: %+v, want a light flow kept on CPU 0 (hash 0: no RPS)", sent, got)
		}
		sent += len(pkt)
	}
	if got := run(t, objs, objs.StxUnderlay, pkt); got.Reason != uint32(stxStxReasonSTX_FIRST) || got.Cpu != 1 {
		t.Errorf("after %d bytes: %+v, want the flow steered to its first choice, CPU 1", sent+len(pkt), got)
	}
	if got := run(t, objs, objs.StxUnderlay, vxlan(innerTCP(portFor(t, 1)+1, tctest.IPOpts{}))); got.Reason != uint32(stxStxReasonSTX_LIGHT) {
		t.Errorf("another flow: %+v, want it light", got)
	}
}

// TestSplitUDP: with udp_batch, a heavy UDP flow's batches take the CPUs
// in turn (mFlow's micro-flows); a TCP flow and a fragmented datagram are
// never split.
func TestSplitUDP(t *testing.T) {
	onCPU0(t)
	objs := loadTest(t)
	configure(t, objs, func(c *stxStxCfg) { c.UdpBatch = 4 })
	setLoads(t, objs, 0, 10, 10)
	udp := func(o tctest.IPOpts) []byte {
		return vxlan(tctest.Eth(mac, mac, 0x0800, tctest.IPv4(o, tctest.ProtoUDP, ipRemote, ipLocal, tctest.UDP(5000, 6000, make([]byte, 1000)))))
	}
	flow := Flow{Src: ipRemote, Dst: ipLocal, Proto: 17, Sport: 5000, Dport: 6000}.hash(0)
	first := firstChoice(flow, loIndex, 2)
	for p := uint32(1); p <= 12; p++ {
		want := (first + p/4) % 2
		if got := run(t, objs, objs.StxUnderlay, udp(tctest.IPOpts{})); got.Reason != uint32(stxStxReasonSTX_SPLIT) || got.Cpu != want {
			t.Errorf("packet %d: %+v, want CPU %d (split)", p, got, want)
		}
	}
	for _, c := range []struct {
		name string
		pkt  []byte
	}{{"TCP", vxlan(innerTCP(1234, tctest.IPOpts{}))}, {"fragment", udp(tctest.IPOpts{Frag: 0x2000})}} {
		for range 8 {
			if got := run(t, objs, objs.StxUnderlay, c.pkt); got.Hash == 0 || got.Reason == uint32(stxStxReasonSTX_SPLIT) {
				t.Fatalf("%s: %+v, want it steered, not split", c.name, got)
			}
		}
	}
}

// TestSticky: a heavy flow keeps the CPU picked for it for the window,
// even when the loads that picked it change: choosing again for every
// packet would spread one flow over two backlogs and reorder it.
func TestSticky(t *testing.T) {
	onCPU0(t)
	objs := loadTest(t)
	configure(t, objs, func(c *stxStxCfg) { c.HeavyBytes, c.WindowNs = 1, uint32(time.Second) })
	pkt := vxlan(innerTCP(portFor(t, 1), tctest.IPOpts{}))
	setLoads(t, objs, 0, 10, 10)
	if got := run(t, objs, objs.StxUnderlay, pkt); got.Cpu != 1 || got.Reason != uint32(stxStxReasonSTX_FIRST) {
		t.Fatalf("first packet: %+v, want its first choice, CPU 1", got)
	}
	setLoads(t, objs, 0, 10, 90)
	for range 5 {
		if got := run(t, objs, objs.StxUnderlay, pkt); got.Cpu != 1 {
			t.Fatalf("CPU 1 loaded within the window: %+v, want the flow kept on CPU 1", got)
		}
	}
}

// TestSeed: the configuration's seed is mixed into every flow's hash, so
// a sender cannot tell which CPU or map slot its flow takes.
func TestSeed(t *testing.T) {
	onCPU0(t)
	objs := loadTest(t)
	const seed = 0x5eed1234
	configure(t, objs, func(c *stxStxCfg) { c.Seed = seed })
	setLoads(t, objs, 0, 10, 10)
	differ := 0
	for p := uint16(1000); p < 1032; p++ {
		f := Flow{Src: ipRemote, Dst: ipLocal, Proto: 6, Sport: p, Dport: 80}
		flow := f.hash(seed)
		want := stxStxReasonSTX_SELF_AVOIDED // (its first choice is CPU 0, running the program)
		if firstChoice(flow, loIndex^seed, 2) == 1 {
			want = stxStxReasonSTX_FIRST
		}
		if firstChoice(flow, loIndex^seed, 2) != firstChoice(f.hash(0), loIndex, 2) {
			differ++
		}
		got := run(t, objs, objs.StxToContainer, innerTCP(p, tctest.IPOpts{}))
		if got.Flow != flow || got.Reason != uint32(want) || got.Hash != hashForIndex(1, 2, mix32(flow^loIndex^seed)) {
			t.Errorf("port %d: %+v, want flow %#x, %v", p, got, flow, want)
		}
	}
	if differ == 0 {
		t.Error("the seed changed no flow's first choice")
	}
}

// TestSeedSplitsCollisions: two flows whose seed-free hashes collide (a
// sender can search for one offline, next to a known flow) get different
// hashes, slots and hence CPUs once seeded: the seed is in the first mix,
// not only in the per-device one.
func TestSeedSplitsCollisions(t *testing.T) {
	a, b := seedFreeCollision(t)
	objs := loadTest(t)
	const seed = 0x5eed1234
	configure(t, objs, func(c *stxStxCfg) { c.Seed = seed })
	setLoads(t, objs, 0, 10, 10)
	frame := func(f Flow) []byte {
		return tctest.Eth(mac, mac, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, f.Src, f.Dst, tctest.TCP(f.Sport, f.Dport, tctest.ACK, []byte("steer"))))
	}
	ga := run(t, objs, objs.StxToContainer, frame(a))
	gb := run(t, objs, objs.StxToContainer, frame(b))
	if ga.Flow == gb.Flow || ga.Hash == gb.Hash {
		t.Errorf("%v and %v (seed-free hash %#x both) share flow %#x / hash %#x with seed %#x", a, b, a.hash(0), ga.Flow, ga.Hash, seed)
	}
	if ga.Flow != a.hash(seed) || gb.Flow != b.hash(seed) {
		t.Errorf("recorded flows %#x, %#x; the Go mirror says %#x, %#x", ga.Flow, gb.Flow, a.hash(seed), b.hash(seed))
	}
}

// seedFreeCollision finds two TCP flows to ipLocal:80 from different
// sources of 10.244.0.0/16 with the same seed-free hash (a birthday
// search: about 2^16 flows).
func seedFreeCollision(t *testing.T) (Flow, Flow) {
	t.Helper()
	seen := map[uint32]Flow{}
	for i := range uint32(1 << 22) {
		src := netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)})
		f := Flow{Src: src, Dst: ipLocal, Proto: 6, Sport: uint16(1024 + i>>16), Dport: 80}
		h := f.hash(0)
		if g, ok := seen[h]; ok && g.Src != f.Src {
			return g, f
		}
		seen[h] = f
	}
	t.Fatal("no seed-free collision found")
	return Flow{}, Flow{}
}
