package cache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/tc/tctest"
)

// Golden packets of the rewriting tunnel (tunnel.h).

const df = 0x4000

// withL4Sum fills in a TCP or UDP checksum for the addresses of its IPv4 header.
func withL4Sum(proto byte, src, dst netip.Addr, seg []byte) []byte {
	seg = append([]byte{}, seg...)
	off := 16
	if proto == tctest.ProtoUDP {
		off = 6
	}
	seg[off], seg[off+1] = 0, 0
	binary.BigEndian.PutUint16(seg[off:], tctest.Csum(append(pseudo(proto, src, dst, len(seg)), seg...)))
	return seg
}

func pseudo(proto byte, src, dst netip.Addr, n int) []byte {
	s, d := src.As4(), dst.As4()
	return append(append(append([]byte{}, s[:]...), d[:]...), 0, proto, byte(n>>8), byte(n))
}

// tunnelCache is a rewriting cache with warm caches for egressTCP's flow,
// the peer announcing the tunnel, and the pair holding keys both ways.
func tunnelCache(t *testing.T, pair *skcRwPair) *fastPath {
	t.Helper()
	c := loadTestCache(t, Capacity{}, TunnelRewrite)
	fill(t, c, true, true, true, true)
	if err := c.objs.SkcPeers.Put(ulPeer.As4(), uint32(1)); err != nil {
		t.Fatal(err)
	}
	if pair != nil {
		if err := c.objs.SkcRwPairs.Put(skcRwPairKey{Local: be32(ipLocal), Remote: be32(ipRemote)}, *pair); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

func now(t *testing.T) uint64 {
	t.Helper()
	n, err := monotonicCoarse()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestRewriteEgress(t *testing.T) {
	for _, tc := range []struct {
		name  string
		proto byte
		seg   []byte
	}{
		{"TCP", tctest.ProtoTCP, withL4Sum(tctest.ProtoTCP, ipLocal, ipRemote, tctest.TCP(40000, 80, tctest.ACK, payload))},
		{"UDP", tctest.ProtoUDP, withL4Sum(tctest.ProtoUDP, ipLocal, ipRemote, tctest.UDP(40000, 80, payload))},
		{"UDP without checksum", tctest.ProtoUDP, tctest.UDP(40000, 80, payload)},
		{"ICMP echo", tctest.ProtoICMP, tctest.ICMP(8, payload)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tunnelCache(t, &skcRwPair{Send: 5, Recv: 9, Heard: now(t)})
			lport, rport := uint16(40000), uint16(80)
			if tc.proto == tctest.ProtoICMP {
				lport, rport = 1, 1
			}
			k := skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(lport), Rport: ntohs(rport), Proto: tc.proto}
			if err := c.objs.SkcFilter.Put(k, skcFilterVal{Egress: 1, Ingress: 1}); err != nil {
				t.Fatal(err)
			}
			in := tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{Frag: df, TOS: 0x01, ID: 0x4321}, tc.proto, ipLocal, ipRemote, tc.seg))
			var ret uint32
			var out []byte
			var skb tctest.Skb
			d := delta(t, c, func() { ret, out, skb = tctest.RunSkb(t, c.objs.FromContainer, in, nil) })
			if tc.proto == tctest.ProtoTCP {
				expectCount(t, d, "from_container/hit", "from_container/rewritten")
			} else { // a datagram may open a flow: no policy compiled here
				expectCount(t, d, "from_container/hit", "from_container/rewritten", "from_container/new_unjudged")
			}
			if ret != tcActRedir || len(out) != len(in) {
				t.Fatalf("ret %d, length %d; want a redirect of %d bytes", ret, len(out), len(in))
			}
			seg := tc.seg
			if tc.name == "TCP" || tc.name == "UDP" {
				seg = withL4Sum(tc.proto, ulLocal, ulPeer, seg)
			}
			want := tctest.Eth(macPeer, macUnderlay, 0x0800, tctest.IPv4(tctest.IPOpts{Frag: df, TOS: 0x01, ID: 5 << 6, TTL: 63}, tc.proto, ulLocal, ulPeer, seg))
			if !bytes.Equal(out, want) {
				t.Errorf("rewritten\n got % x\nwant % x", out, want)
			}
			if skb.Mark != RewriteMark {
				t.Errorf("mark %#x, want %#x", skb.Mark, RewriteMark)
			}
		})
	}
}

// vxFlags runs from_container on a data segment of the flow and returns
// the VXLAN header's reserved bytes of what it sent (nil: not VXLAN).
func vxFlags(t *testing.T, c *fastPath, o tctest.IPOpts) []byte {
	t.Helper()
	in := egressTCP(o, tctest.ACK)
	ret, out := tctest.Run(t, c.objs.FromContainer, in)
	if ret != tcActRedir || len(out) != len(in)+50 {
		t.Fatalf("ret %d, length %d: want VXLAN (%d bytes)", ret, len(out), len(in)+50)
	}
	return out[43:46]
}

func TestRewriteFallsBackToVXLAN(t *testing.T) {
	fresh := func(t *testing.T) uint64 { return now(t) }
	for _, tc := range []struct {
		name string
		pair *skcRwPair
		opts tctest.IPOpts
		vx   []byte // reserved bytes 1-3 of the VXLAN header
	}{
		{"no DF", &skcRwPair{Send: 5, Recv: 9}, tctest.IPOpts{}, []byte{0x60, 0, 9}},
		{"DSCP", &skcRwPair{Send: 5, Recv: 9}, tctest.IPOpts{Frag: df, TOS: 0x20}, []byte{0x60, 0, 9}},
		{"TTL 15", &skcRwPair{Send: 5, Recv: 9}, tctest.IPOpts{Frag: df, TTL: 15}, []byte{0x60, 0, 9}},
		{"advert pending", &skcRwPair{Send: 5, Recv: 9, Pending: 1}, tctest.IPOpts{Frag: df}, []byte{0xe0, 0, 9}},
		{"no key from the peer", &skcRwPair{Recv: 300, Pending: 1}, tctest.IPOpts{Frag: df}, []byte{0xa0, 1, 44}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.pair.Heard = fresh(t)
			c := tunnelCache(t, tc.pair)
			if got := vxFlags(t, c, tc.opts); !bytes.Equal(got, tc.vx) {
				t.Errorf("VXLAN reserved bytes % x, want % x", got, tc.vx)
			}
		})
	}
	t.Run("too big for VXLAN", func(t *testing.T) {
		c := tunnelCache(t, &skcRwPair{Send: 5, Recv: 9, Heard: now(t)})
		big := make([]byte, 1500-20-20) // a full-MTU segment, with a DSCP: not rewritten
		in := tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{Frag: df, TOS: 0x20}, tctest.ProtoTCP, ipLocal, ipRemote, tctest.TCP(40000, 80, tctest.ACK, big)))
		var ret uint32
		var out []byte
		d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromContainer, in) })
		expectCount(t, d, "from_container/too_big_for_vxlan")
		if ret != tcNext || !bytes.Equal(out, in) {
			t.Errorf("ret %d, changed %v: want the overlay's, untouched", ret, !bytes.Equal(out, in))
		}
		// One byte less than VXLAN's room goes in VXLAN.
		in = tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(tctest.IPOpts{Frag: df, TOS: 0x20}, tctest.ProtoTCP, ipLocal, ipRemote, tctest.TCP(40000, 80, tctest.ACK, big[:1450-40])))
		if ret, out := tctest.Run(t, c.objs.FromContainer, in); ret != tcActRedir || len(out) != len(in)+50 {
			t.Errorf("a packet of 1450 bytes: ret %d, length %d", ret, len(out))
		}
	})
	t.Run("not heard from for 5 s", func(t *testing.T) {
		c := tunnelCache(t, &skcRwPair{Send: 5, Recv: 9, Heard: now(t) - 6e9})
		if got := vxFlags(t, c, tctest.IPOpts{Frag: df}); !bytes.Equal(got, []byte{0x60, 0, 9}) {
			t.Errorf("VXLAN reserved bytes % x", got)
		}
	})
	t.Run("a new pair", func(t *testing.T) {
		c := tunnelCache(t, nil)
		got := vxFlags(t, c, tctest.IPOpts{Frag: df})
		key := binary.BigEndian.Uint16(got[1:])
		if got[0] != 0xa0 || key == 0 || key > 511 {
			t.Fatalf("VXLAN reserved bytes % x: want an advert of a new key", got)
		}
		var v skcRwKey
		if err := c.objs.SkcRwKeys.Lookup(skcRwKeyKey{Peer: be32(ulPeer), Key: key}, &v); err != nil || v.Remote != be32(ipRemote) || v.Local != be32(ipLocal) || v.Dead != 0 {
			t.Errorf("key %d: %+v, %v", key, v, err)
		}
	})
	t.Run("peer without the tunnel", func(t *testing.T) {
		c := tunnelCache(t, &skcRwPair{Send: 5, Recv: 9, Heard: now(t)})
		if err := c.objs.SkcPeers.Delete(ulPeer.As4()); err != nil {
			t.Fatal(err)
		}
		if got := vxFlags(t, c, tctest.IPOpts{Frag: df}); !bytes.Equal(got, []byte{0, 0, 0}) {
			t.Errorf("VXLAN reserved bytes % x, want none", got)
		}
	})
	t.Run("VXLAN tunnel", func(t *testing.T) {
		c := newTestCache(t, Capacity{})
		fill(t, c, true, true, true, true)
		if got := vxFlags(t, c, tctest.IPOpts{Frag: df}); !bytes.Equal(got, []byte{0, 0, 0}) {
			t.Errorf("VXLAN reserved bytes % x, want none", got)
		}
	})
}

// rewrittenTCP is the peer's rewrite of ingressTCP's segment with key.
func rewrittenTCP(o tctest.IPOpts, key uint16) []byte {
	o.ID = key << 6
	return tctest.Eth(macUnderlay, macPeer, 0x0800, tctest.IPv4(o, tctest.ProtoTCP, ulPeer, ulLocal,
		withL4Sum(tctest.ProtoTCP, ulPeer, ulLocal, tctest.TCP(80, 40000, tctest.ACK, payload))))
}

func putKey(t *testing.T, c *fastPath, key uint16, v skcRwKey) {
	t.Helper()
	if err := c.objs.SkcRwKeys.Put(skcRwKeyKey{Peer: be32(ulPeer), Key: key}, v); err != nil {
		t.Fatal(err)
	}
}

func TestRestoreIngress(t *testing.T) {
	c := tunnelCache(t, &skcRwPair{Send: 5, Recv: 9, Pending: 1})
	putKey(t, c, 9, skcRwKey{Remote: be32(ipRemote), Local: be32(ipLocal)})
	in := rewrittenTCP(tctest.IPOpts{Frag: df, TTL: 63}, 9)
	var ret uint32
	var out []byte
	d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromUnderlay, in) })
	expectCount(t, d, "from_underlay/hit", "from_underlay/restored")
	if ret != tcActRedir {
		t.Fatalf("ret %d, want redirect", ret)
	}
	want := tctest.Eth(macContainer, macBridge, 0x0800, tctest.IPv4(tctest.IPOpts{Frag: df, TTL: 62, ID: 9 << 6}, tctest.ProtoTCP, ipRemote, ipLocal,
		withL4Sum(tctest.ProtoTCP, ipRemote, ipLocal, tctest.TCP(80, 40000, tctest.ACK, payload))))
	if !bytes.Equal(out, want) {
		t.Errorf("restored\n got % x\nwant % x", out, want)
	}
	var p skcRwPair
	if err := c.objs.SkcRwPairs.Lookup(skcRwPairKey{Local: be32(ipLocal), Remote: be32(ipRemote)}, &p); err != nil || p.Pending != 0 || p.Heard == 0 {
		t.Errorf("pair after a packet with its key: %+v, %v (want the advert acknowledged, the peer heard)", p, err)
	}
}

func TestRestoreToOverlay(t *testing.T) {
	c := tunnelCache(t, nil)
	if err := c.objs.SkcFilter.Delete(skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40000), Rport: ntohs(80), Proto: tctest.ProtoTCP}); err != nil {
		t.Fatal(err)
	}
	putKey(t, c, 9, skcRwKey{Remote: be32(ipRemote), Local: be32(ipLocal)})
	in := rewrittenTCP(tctest.IPOpts{Frag: df, TTL: 63}, 9)
	// No VXLAN device known: nowhere to hand it.
	if ret, _ := tctest.Run(t, c.objs.FromUnderlay, in); ret != tcActShot {
		t.Errorf("without a VXLAN device: ret %d, want a drop", ret)
	}
	c.ctl.Vxlan = 12
	if err := c.objs.SkcControl.Put(uint32(0), c.ctl); err != nil {
		t.Fatal(err)
	}
	var ret uint32
	var out []byte
	d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromUnderlay, in) })
	expectCount(t, d, "from_underlay/restored", "from_underlay/miss_filter", "from_underlay/restored_to_overlay")
	if ret != tcActRedir {
		t.Fatalf("ret %d, want a redirect into the VXLAN device", ret)
	}
	want := tctest.Eth(macVTEP, macPeerVTEP, 0x0800, tctest.IPv4(tctest.IPOpts{Frag: df, TTL: 63, ID: 9 << 6, TOS: markMiss}, tctest.ProtoTCP, ipRemote, ipLocal,
		withL4Sum(tctest.ProtoTCP, ipRemote, ipLocal, tctest.TCP(80, 40000, tctest.ACK, payload))))
	if !bytes.Equal(out, want) {
		t.Errorf("handed to the overlay\n got % x\nwant % x", out, want)
	}
}

func TestRestoreRefuses(t *testing.T) {
	live := skcRwKey{Remote: be32(ipRemote), Local: be32(ipLocal)}
	for _, tc := range []struct {
		name   string
		key    *skcRwKey
		home   netip.Addr // where skc_egress_ip puts ipRemote
		pkt    []byte
		drop   bool
		reason string
	}{
		{name: "unknown key", pkt: rewrittenTCP(tctest.IPOpts{Frag: df}, 9), drop: true, reason: "from_underlay/rewrite_unknown_key"},
		{name: "dead key", key: &skcRwKey{Dead: 1}, pkt: rewrittenTCP(tctest.IPOpts{Frag: df}, 9), drop: true, reason: "from_underlay/rewrite_dead_key"},
		{name: "source not on the peer", key: &live, home: ulOther, pkt: rewrittenTCP(tctest.IPOpts{Frag: df}, 9), drop: true, reason: "from_underlay/rewrite_spoofed"},
		{name: "scrubbed", key: &live, pkt: rewrittenTCP(tctest.IPOpts{Frag: df}, 9|0x200), reason: "from_underlay/pass_not_vxlan"},
		{name: "key 0", key: &live, pkt: rewrittenTCP(tctest.IPOpts{Frag: df}, 0), reason: "from_underlay/pass_not_vxlan"},
		{name: "no DF", key: &live, pkt: rewrittenTCP(tctest.IPOpts{}, 9), reason: "from_underlay/pass_not_vxlan"},
		{name: "fragment", key: &live, pkt: rewrittenTCP(tctest.IPOpts{Frag: df | 0x2000}, 9), reason: "from_underlay/pass_not_vxlan"},
		{name: "not from a peer", key: &live, pkt: tctest.Eth(macUnderlay, macPeer, 0x0800, tctest.IPv4(tctest.IPOpts{Frag: df, ID: 9 << 6}, tctest.ProtoTCP, ulOther, ulLocal, tctest.TCP(80, 40000, tctest.ACK, payload))), reason: "from_underlay/pass_not_vxlan"},
		{name: "to another address", key: &live, pkt: tctest.Eth(macUnderlay, macPeer, 0x0800, tctest.IPv4(tctest.IPOpts{Frag: df, ID: 9 << 6}, tctest.ProtoTCP, ulPeer, ulOther, tctest.TCP(80, 40000, tctest.ACK, payload))), reason: "from_underlay/pass_not_vxlan"},
		{name: "truncated", key: &live, pkt: rewrittenTCP(tctest.IPOpts{Frag: df}, 9)[:14+20+10], drop: true, reason: "from_underlay/error_decap"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tunnelCache(t, nil)
			if tc.key != nil {
				putKey(t, c, 9, *tc.key)
			}
			if tc.home.IsValid() {
				if err := c.objs.SkcEgressIp.Put(be32(ipRemote), be32(tc.home)); err != nil {
					t.Fatal(err)
				}
			}
			var ret uint32
			var out []byte
			d := delta(t, c, func() { ret, out = tctest.Run(t, c.objs.FromUnderlay, tc.pkt) })
			expectCount(t, d, tc.reason)
			if tc.drop && ret != tcActShot || !tc.drop && (ret != tcNext || !bytes.Equal(out, tc.pkt)) {
				t.Errorf("ret %d (drop: %v), packet changed: %v", ret, tc.drop, !bytes.Equal(out, tc.pkt))
			}
		})
	}
	t.Run("an unknown key is dead from then on", func(t *testing.T) {
		c := tunnelCache(t, nil)
		tctest.Run(t, c.objs.FromUnderlay, rewrittenTCP(tctest.IPOpts{Frag: df}, 9))
		var v skcRwKey
		if err := c.objs.SkcRwKeys.Lookup(skcRwKeyKey{Peer: be32(ulPeer), Key: 9}, &v); err != nil || v.Dead != 1 {
			t.Errorf("key 9 after a packet with it: %+v, %v", v, err)
		}
	})
}

func TestAdverts(t *testing.T) {
	c := tunnelCache(t, &skcRwPair{Recv: 9, Pending: 1})
	in := ingressTCP(tctest.IPOpts{}, tctest.ACK)
	in[43], in[44], in[45] = 0xe0, 0x01, 0x05 // peer, ACK, ADV 261
	ret, out := tctest.Run(t, c.objs.FromUnderlay, in)
	if ret != tcActRedir || len(out) != len(in)-50 {
		t.Fatalf("ret %d", ret)
	}
	var p skcRwPair
	if err := c.objs.SkcRwPairs.Lookup(skcRwPairKey{Local: be32(ipLocal), Remote: be32(ipRemote)}, &p); err != nil {
		t.Fatal(err)
	}
	if p.Send != 261 || p.Pending != 0 || p.Heard == 0 {
		t.Errorf("pair %+v: want the peer's key 261 learnt, the advert acknowledged", p)
	}
	// A VXLAN packet of the peer's fast path without ACK: it lost this
	// host's key; advertise it again.
	in[43] = 0x20
	tctest.Run(t, c.objs.FromUnderlay, in)
	c.objs.SkcRwPairs.Lookup(skcRwPairKey{Local: be32(ipLocal), Remote: be32(ipRemote)}, &p)
	if p.Pending != 1 {
		t.Errorf("pair %+v: want the advert pending again", p)
	}
	// The reserved bytes never reach the VXLAN device.
	c2 := tunnelCache(t, nil)
	if err := c2.objs.SkcFilter.Delete(skcFlowKey{Laddr: be32(ipLocal), Raddr: be32(ipRemote), Lport: ntohs(40000), Rport: ntohs(80), Proto: tctest.ProtoTCP}); err != nil {
		t.Fatal(err)
	}
	in[43], in[44], in[45] = 0xa0, 0, 7
	ret, out = tctest.Run(t, c2.objs.FromUnderlay, in) // a miss: the stack's
	if ret != tcNext || !bytes.Equal(out[43:46], []byte{0, 0, 0}) {
		t.Errorf("ret %d, reserved bytes % x passed on", ret, out[43:46])
	}
	// Only from where the inner source lives.
	c3 := tunnelCache(t, nil)
	if err := c3.objs.SkcEgressIp.Put(be32(ipRemote), be32(ulOther)); err != nil {
		t.Fatal(err)
	}
	tctest.Run(t, c3.objs.FromUnderlay, in)
	if err := c3.objs.SkcRwPairs.Lookup(skcRwPairKey{Local: be32(ipLocal), Remote: be32(ipRemote)}, &p); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("an advert from a host the source does not live on was learnt: %+v", p)
	}
}

func TestScrub(t *testing.T) {
	c := tunnelCache(t, nil)
	host := func(dst netip.Addr, o tctest.IPOpts) []byte {
		return tctest.Eth(macPeer, macUnderlay, 0x0800, tctest.IPv4(o, tctest.ProtoTCP, ulLocal, dst, tctest.TCP(40000, 80, tctest.ACK, payload)))
	}
	for _, tc := range []struct {
		name string
		in   []byte
		mark uint32
		id   uint16 // 0: untouched
	}{
		{name: "to a peer", in: host(ulPeer, tctest.IPOpts{Frag: df, ID: 0x1234}), id: 0x9234},
		{name: "to a peer, bit 15 set", in: host(ulPeer, tctest.IPOpts{Frag: df, ID: 0x9234})},
		{name: "to another host", in: host(ulOther, tctest.IPOpts{Frag: df, ID: 0x1234})},
		{name: "no DF", in: host(ulPeer, tctest.IPOpts{ID: 0x1234})},
		{name: "rewritten", in: host(ulPeer, tctest.IPOpts{Frag: df, ID: 0x1234}), mark: RewriteMark},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ret, out, _ := tctest.RunSkb(t, c.objs.ToUnderlay, tc.in, &tctest.Skb{Mark: tc.mark})
			if ret != tcNext {
				t.Fatalf("ret %d", ret)
			}
			if tc.id == 0 {
				if !bytes.Equal(out, tc.in) {
					t.Error("packet changed")
				}
				return
			}
			ipAt(t, out, 14)
			if got := binary.BigEndian.Uint16(out[18:]); got != tc.id {
				t.Errorf("ID %#x, want %#x", got, tc.id)
			}
		})
	}
	// A host in the VXLAN tunnel scrubs too: a peer may still restore
	// its packets until it learns that this host stopped rewriting.
	v := newTestCache(t, Capacity{})
	if err := v.objs.SkcPeers.Put(ulPeer.As4(), uint32(1)); err != nil {
		t.Fatal(err)
	}
	in := host(ulPeer, tctest.IPOpts{Frag: df, ID: 0x1234})
	if _, out := tctest.Run(t, v.objs.ToUnderlay, in); binary.BigEndian.Uint16(out[18:]) != 0x9234 {
		t.Error("the VXLAN tunnel did not scrub a packet to a peer")
	}
}

// TestTunnelCoherency: the agent's side of the tunnel. Sync makes the
// peers the live hosts that announce it, drops the pairs of containers
// that are gone or moved and kills their keys; a removed container's
// pairs go and its keys die; the sweep kills keys no pair holds and frees
// keys dead long enough.
func TestTunnelCoherency(t *testing.T) {
	c := loadTestCache(t, Capacity{}, TunnelRewrite)
	remote2 := netip.MustParseAddr("10.244.2.8")
	put := func(local, remote netip.Addr, recv uint16) {
		t.Helper()
		if err := c.objs.SkcRwPairs.Put(skcRwPairKey{Local: be32(local), Remote: be32(remote)}, skcRwPair{Send: 3, Recv: recv}); err != nil {
			t.Fatal(err)
		}
		putKey(t, c, recv, skcRwKey{Remote: be32(remote), Local: be32(local)})
	}
	put(ipLocal, ipRemote, 10)
	put(ipLocal2, ipRemote, 11)
	put(ipLocal, remote2, 12)
	keyOf := func(k uint16) (skcRwKey, bool) {
		var v skcRwKey
		err := c.objs.SkcRwKeys.Lookup(skcRwKeyKey{Peer: be32(ulPeer), Key: k}, &v)
		return v, err == nil
	}
	pairs := func() int { return count(t, c.objs.SkcRwPairs) }
	hosts := []cluster.Host{
		{Name: "h1", UnderlayIP: ulLocal, Subnet: netip.MustParsePrefix("10.244.1.0/24"), Features: []string{FeatureRewrite}},
		{Name: "h2", UnderlayIP: ulPeer, Subnet: netip.MustParsePrefix("10.244.2.0/24"), Features: []string{FeatureRewrite}},
		{Name: "h3", UnderlayIP: ulOther, Subnet: netip.MustParsePrefix("10.244.3.0/24")},
	}
	eps := []cluster.Endpoint{
		{Host: "h1", IP: netip.PrefixFrom(ipLocal, 24)}, {Host: "h1", IP: netip.PrefixFrom(ipLocal2, 24)},
		{Host: "h2", IP: netip.PrefixFrom(ipRemote, 24)}, {Host: "h2", IP: netip.PrefixFrom(remote2, 24)},
	}
	if err := c.Sync(eps, hosts); err != nil {
		t.Fatal(err)
	}
	var one uint32
	if c.objs.SkcPeers.Lookup(ulPeer.As4(), &one) != nil || c.objs.SkcPeers.Lookup(ulOther.As4(), &one) == nil || pairs() != 3 {
		t.Fatalf("after a sync of an unchanged cluster: peers wrong or %d pairs", pairs())
	}
	// remote2 moves to h3, which does not rewrite: its pair goes, its key dies.
	eps[3].Host = "h3"
	if err := c.Sync(eps, hosts); err != nil {
		t.Fatal(err)
	}
	if v, ok := keyOf(12); pairs() != 2 || !ok || v.Dead != 1 {
		t.Errorf("after a move to a host without the tunnel: %d pairs, key 12 %+v", pairs(), v)
	}
	// A local container goes.
	if err := c.RemoveEndpoint(cluster.Endpoint{IP: netip.PrefixFrom(ipLocal2, 24)}); err != nil {
		t.Fatal(err)
	}
	if v, ok := keyOf(11); pairs() != 1 || !ok || v.Dead != 1 {
		t.Errorf("after the container went: %d pairs, key 11 %+v", pairs(), v)
	}
	// A key no pair holds dies at the sweep; a key dead past its life is freed.
	putKey(t, c, 13, skcRwKey{Remote: be32(ipRemote), Local: be32(ipLocal)})
	putKey(t, c, 14, skcRwKey{Dead: 1, Seen: now(t) - uint64(deadKeyLife) - 1e9})
	if _, err := c.sweepKeys(); err != nil {
		t.Fatal(err)
	}
	if v, ok := keyOf(13); !ok || v.Dead != 1 {
		t.Errorf("a key no pair holds: %+v", v)
	}
	if _, ok := keyOf(14); ok {
		t.Error("a key dead past its life was not freed")
	}
	if v, ok := keyOf(10); !ok || v.Dead != 0 {
		t.Errorf("the live pair's key: %+v", v)
	}
	// h2 stops announcing: nothing is rewritten to it any more.
	hosts[1].Features = nil
	if err := c.Sync(eps, hosts); err != nil {
		t.Fatal(err)
	}
	if v, ok := keyOf(10); pairs() != 0 || !ok || v.Dead != 1 || c.objs.SkcPeers.Lookup(ulPeer.As4(), &one) == nil {
		t.Errorf("after the peer withdrew: %d pairs, key 10 %+v", pairs(), v)
	}
}
