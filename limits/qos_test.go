package limits

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/tc/tctest"
)

// TestQoSMarks: skq_underlay gives the VXLAN packets of a high or low
// class container the class's DSCP in the outer header (ECN bits kept,
// checksum valid) and skb->priority, a normal container's the normal
// class's priority whatever the container chose, and leaves everything
// else as it came: other UDP, IPv6, a VXLAN packet too short to hold an
// inner IPv4 header.
func TestQoSMarks(t *testing.T) {
	var objs skqObjects
	spec, err := loadSkq()
	if err != nil {
		t.Fatal(err)
	}
	if err := spec.Variables["cfg_vxlan_port"].Set(bpfmap.Port(4789)); err != nil {
		t.Fatal(err)
	}
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: bpffstest.Dir(t)}}); err != nil {
		t.Fatalf("%+v", err)
	}
	defer objs.Close()
	high, low, normal := netip.MustParseAddr("10.244.1.5"), netip.MustParseAddr("10.244.1.6"), netip.MustParseAddr("10.244.1.7")
	q := &QoS{objs: objs}
	if err := q.Sync(map[netip.Addr]string{high: cluster.ClassHigh, low: cluster.ClassLow, normal: cluster.ClassNormal}); err != nil {
		t.Fatal(err)
	}
	if n := classCount(t, objs.SkqClasses); n != 2 {
		t.Errorf("%d entries, want 2 (normal needs none)", n)
	}
	ul1, ul2 := netip.MustParseAddr("10.99.0.1"), netip.MustParseAddr("10.99.0.2")
	vxlan := func(src netip.Addr, outerTOS byte, dport uint16) []byte {
		inner := tctest.Eth(mac, mac, 0x0800, tctest.IPv4(tctest.IPOpts{}, tctest.ProtoTCP, src, netip.MustParseAddr("10.244.2.9"), tctest.TCP(1, 2, tctest.ACK, nil)))
		return tctest.VXLAN(tctest.IPOpts{TOS: outerTOS}, mac, mac, ul1, ul2, 1, dport, inner)
	}
	run := func(p []byte, priority uint32) (int32, []byte, uint32) {
		out, ctx, in := make([]byte, len(p)+64), make([]byte, 192), make([]byte, 192)
		binary.NativeEndian.PutUint32(in[32:], priority)
		opts := &ebpf.RunOptions{Data: p, DataOut: out, Context: in, ContextOut: ctx}
		ret, err := objs.SkqUnderlay.Run(opts)
		if err != nil {
			t.Fatalf("BPF_PROG_RUN: %v", err)
		}
		return int32(ret), opts.DataOut[:len(p)], binary.NativeEndian.Uint32(ctx[32:])
	}
	for _, c := range []struct {
		name      string
		src       netip.Addr
		tos, want byte
		priority  uint32
	}{{"high", high, 0, 0x80, 0x5c0006}, {"high, ECN kept", high, 0x02, 0x82, 0x5c0006}, {"low", low, 0x01, 0x21, 0x5c0002}} {
		ret, out, prio := run(vxlan(c.src, c.tos, 4789), 0x5c0000)
		if ret != -1 || out[15] != c.want || prio != c.priority {
			t.Errorf("%s: verdict %d, outer TOS %#x, priority %#x; want TC_ACT_UNSPEC, %#x, %#x", c.name, ret, out[15], prio, c.want, c.priority)
		}
		if tctest.Csum(out[14:34]) != 0 {
			t.Errorf("%s: outer IPv4 checksum wrong after the TOS changed", c.name)
		}
	}
	// A normal container's packet gets the normal class's priority,
	// whatever the container chose: HTB's direct queue (5c:0) or the
	// high class's id would otherwise pick the underlay's way for it.
	for _, chosen := range []uint32{0, 6, 0x5c0000, 0x5c0006} {
		p := vxlan(normal, 0, 4789)
		if ret, out, prio := run(p, chosen); ret != -1 || !bytes.Equal(out, p) || prio != 0x5c0008 {
			t.Errorf("normal class, priority %#x chosen: verdict %d, priority %#x, changed %v; want the normal class's 0x5c0008, bytes untouched",
				chosen, ret, prio, !bytes.Equal(out, p))
		}
	}
	for name, p := range map[string][]byte{
		"not VXLAN":     vxlan(high, 0, 4790),
		"IPv6":          tctest.Eth(mac, mac, 0x86dd, payload1k),
		"no inner IPv4": vxlan(high, 0, 4789)[:14+20+8+8+14+10],
	} {
		ret, out, prio := run(p, 0)
		if ret != -1 || !bytes.Equal(out, p) || prio != 0 {
			t.Errorf("%s: verdict %d, priority %#x, changed %v; want it untouched", name, ret, prio, !bytes.Equal(out, p))
		}
	}
	// A container that leaves, or turns normal, loses its entry.
	if err := q.Sync(map[netip.Addr]string{low: cluster.ClassNormal}); err != nil {
		t.Fatal(err)
	}
	if n := classCount(t, objs.SkqClasses); n != 0 {
		t.Errorf("%d entries after the classes went, want 0", n)
	}
}

func classCount(t *testing.T, m *ebpf.Map) int {
	all, err := bpfmap.Entries[[4]byte, skqSkqClass](m)
	if err != nil {
		t.Fatal(err)
	}
	return len(all)
}
