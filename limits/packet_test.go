package limits

import (
	"bufio"
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/tc/tctest"
)

// testCgroup returns the cgroup v2 id of this process, which
// BPF_PROG_RUN gives the socket of a cgroup_skb test packet; it mounts
// cgroup2 for the test where the machine has not.
func testCgroup(t *testing.T) uint64 {
	t.Helper()
	root := ""
	mounts, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(mounts), "\n") {
		if f := strings.Fields(line); len(f) > 2 && f[2] == "cgroup2" {
			root = f[1]
			break
		}
	}
	if root == "" {
		root = t.TempDir()
		if err := unix.Mount("cgroup2", root, "cgroup2", 0, ""); err != nil {
			t.Fatalf("mount cgroup2: %v", err)
		}
		t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	}
	self, err := os.Open("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	for s := bufio.NewScanner(self); s.Scan(); {
		if p, ok := strings.CutPrefix(s.Text(), "0::"); ok {
			var st unix.Stat_t
			if err := unix.Stat(filepath.Join(root, p), &st); err != nil {
				t.Fatal(err)
			}
			return st.Ino
		}
	}
	t.Fatal("no cgroup v2 line in /proc/self/cgroup")
	return 0
}

func loadTest(t *testing.T) *sklObjects {
	t.Helper()
	var objs sklObjects
	if err := loadSklObjects(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: bpffstest.Dir(t)}}); err != nil {
		t.Fatalf("load: %+v", err)
	}
	t.Cleanup(func() { objs.Close() })
	return &objs
}

var (
	mac        = net.HardwareAddr{2, 0, 0, 0, 0, 1}
	src, dst   = netip.MustParseAddr("10.244.0.2"), netip.MustParseAddr("10.99.0.2")
	payload1k  = make([]byte, 1000)
	tcpSegment = tctest.Eth(mac, mac, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, src, dst, tctest.TCP(40000, 80, tctest.ACK, payload1k)))
	udpDgram   = tctest.Eth(mac, mac, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, src, dst, tctest.UDP(40000, 53, payload1k)))
)

// TestBuckets: the cgroup programs pass what is within a container's
// limit and nothing of a container without one; over it, egress TCP is
// told to wait (2: dropped with congestion notification, kept queued),
// other egress and all ingress dropped; the bucket refills at the rate;
// what is not IPv4 is judged as not TCP.
func TestBuckets(t *testing.T) {
	objs := loadTest(t)
	cg := testCgroup(t)
	run := func(p []byte, ingress bool) uint32 {
		prog := objs.SklEgress
		if ingress {
			prog = objs.SklIngress
		}
		ret, err := prog.Run(&ebpf.RunOptions{Data: p})
		if err != nil {
			t.Fatalf("BPF_PROG_RUN: %v", err)
		}
		return ret
	}
	if r := run(tcpSegment, false); r != 1 {
		t.Fatalf("no limit: egress verdict %d, want 1", r)
	}
	// 1 packet of burst, 100 kB/s: the second packet in a row is over.
	l := sklSklLimit{Rate: [2]uint64{100_000, 100_000}, Burst: [2]uint64{1100, 1100}, Pace: ^uint32(0)}
	if err := objs.SklLimits.Put(cg, l); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name    string
		p       []byte
		ingress bool
		over    uint32
	}{{"egress TCP", tcpSegment, false, 2}, {"egress UDP", udpDgram, false, 0}, {"ingress TCP", tcpSegment, true, 0},
		{"egress not IPv4", tctest.Eth(mac, mac, 0x86dd, payload1k), false, 0}} {
		objs.SklBuckets.Delete(cg)
		if r := run(c.p, c.ingress); r != 1 {
			t.Errorf("%s within the burst: verdict %d, want 1", c.name, r)
		}
		if r := run(c.p, c.ingress); r != c.over {
			t.Errorf("%s over the limit: verdict %d, want %d", c.name, r, c.over)
		}
	}
	objs.SklBuckets.Delete(cg)
	run(tcpSegment, true)
	time.Sleep(20 * time.Millisecond) // 2 000 bytes at 100 kB/s: the bucket is full again
	if r := run(tcpSegment, true); r != 1 {
		t.Errorf("after a refill: verdict %d, want 1", r)
	}
	// A slow rate and packets closer together than a byte's worth of time
	// (the rate's 1 000 bytes/s: 1 ms a byte): the bucket still refills,
	// about one packet's worth a second.
	l = sklSklLimit{Rate: [2]uint64{1000, 1000}, Burst: [2]uint64{1100, 1100}, Pace: ^uint32(0)}
	objs.SklLimits.Put(cg, l)
	objs.SklBuckets.Delete(cg)
	passed := 0
	for start := time.Now(); time.Since(start) < 2500*time.Millisecond; time.Sleep(200 * time.Microsecond) {
		if run(tcpSegment, true) == 1 {
			passed++
		}
	}
	if passed < 2 || passed > 4 {
		t.Errorf("1 000 bytes/s for 2.5 s, a packet every 0.2 ms: %d of ~1 050 bytes passed, want 2-4 (the burst, then the refill)", passed)
	}
	// After a second idle the bucket is full again, whatever the rate.
	time.Sleep(1100 * time.Millisecond)
	if r := run(tcpSegment, true); r != 1 {
		t.Errorf("after a second idle: verdict %d, want 1", r)
	}
	// A zero rate that way limits nothing.
	l.Rate[1] = 0
	objs.SklLimits.Put(cg, l)
	for range 3 {
		if r := run(tcpSegment, true); r != 1 {
			t.Fatalf("no ingress rate: verdict %d, want 1", r)
		}
	}
}

// TestEntry: a limit as the programs apply it.
func TestEntry(t *testing.T) {
	e := entry(cluster.Limit{EgressRate: 8e6, EgressBurst: 8e5})
	if e.Rate[0] != 1_050_000 || e.Burst[0] != 100_000 || e.Rate[1] != 0 || e.Pace != 1_000_000 {
		t.Errorf("1 MB/s egress: %+v", e)
	}
	if e := entry(cluster.Limit{IngressRate: 1e9, IngressBurst: cluster.MinBurst}); e.Burst[1] != 1e9*Headroom/8/10 || e.Pace != ^uint32(0) {
		t.Errorf("1 Gbit/s ingress: burst %d (want 100 ms), pace %d", e.Burst[1], e.Pace)
	}
	if e := entry(cluster.Limit{EgressRate: 1e12, EgressBurst: 1e9}); e.Pace != ^uint32(0) {
		t.Errorf("1 Tbit/s is not paced (above what SO_MAX_PACING_RATE takes): %d", e.Pace)
	}
}

// TestClassify: a packet for a host socket of a container with an
// ingress class is redirected to the IFB with the class in skb->priority;
// packets for sockets of containers without one, for no socket, and what
// is not a whole IPv4 TCP header are left to the next filter.
func TestClassify(t *testing.T) {
	objs := loadTest(t)
	cg := testCgroup(t)
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	lo := netip.MustParseAddr("127.0.0.1")
	syn := func(dport uint16) []byte {
		return tctest.Eth(mac, mac, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, lo, lo, tctest.TCP(40000, dport, tctest.SYN, nil)))
	}
	run := func(p []byte) (int32, uint32) {
		out := make([]byte, 192)
		opts := &ebpf.RunOptions{Data: p, DataOut: make([]byte, len(p)+256), Context: make([]byte, 192), ContextOut: out}
		ret, err := objs.SklClassify.Run(opts)
		if err != nil {
			t.Fatalf("BPF_PROG_RUN of %d bytes: %v", len(p), err)
		}
		return int32(ret), binary.NativeEndian.Uint32(out[32:]) // __sk_buff.priority
	}
	const unspec, redirect = -1, 7
	if ret, _ := run(syn(port)); ret != unspec {
		t.Errorf("socket of a container without a limit: %d, want TC_ACT_UNSPEC", ret)
	}
	if err := objs.SklLimits.Put(cg, sklSklLimit{Rate: [2]uint64{0, 1e6}, Burst: [2]uint64{0, 1e5}, Pace: ^uint32(0), Class: 7}); err != nil {
		t.Fatal(err)
	}
	if ret, _ := run(syn(port)); ret != unspec {
		t.Errorf("no IFB yet: verdict %d, want TC_ACT_UNSPEC (never a redirect to nowhere)", ret)
	}
	if err := objs.SklIfb.Put(uint32(0), uint32(42)); err != nil {
		t.Fatal(err)
	}
	if ret, prio := run(syn(port)); ret != redirect || prio != 0x5c0007 {
		t.Errorf("socket of a limited container: verdict %d priority %#x, want TC_ACT_REDIRECT and 5c:7", ret, prio)
	}
	for name, p := range map[string][]byte{
		"no socket":       syn(port + 1),
		"truncated TCP":   syn(port)[:14+20+10],
		"not IPv4":        tctest.Eth(mac, mac, 0x86dd, payload1k),
		"UDP to the port": tctest.Eth(mac, mac, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, lo, lo, tctest.UDP(40000, port, nil))),
	} {
		if ret, _ := run(p); ret != unspec {
			t.Errorf("%s: verdict %d, want TC_ACT_UNSPEC", name, ret)
		}
	}
	if n, _ := (&Cgroups{objs: *objs}).Counters(); n["shaped"] != 1 {
		t.Errorf("shaped counter %d, want 1", n["shaped"])
	}
}
