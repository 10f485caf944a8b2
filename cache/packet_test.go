package cache

import (
	"encoding/binary"
	"net"
	"net/netip"
)

// Packet builders for the golden-packet tests: just enough Ethernet, IPv4,
// TCP/UDP/ICMP and VXLAN to write the cases down readably.

var (
	macContainer = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0c}
	macBridge    = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0b}
	macUnderlay  = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x01} // this host's underlay
	macPeer      = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x02} // remote host's underlay
	macVTEP      = net.HardwareAddr{0x0e, 0x5f, 10, 99, 0, 1}
	macPeerVTEP  = net.HardwareAddr{0x0e, 0x5f, 10, 99, 0, 2}

	ipLocal  = netip.MustParseAddr("10.244.1.5") // container on this host
	ipLocal2 = netip.MustParseAddr("10.244.1.6")
	ipRemote = netip.MustParseAddr("10.244.2.7") // container on the remote host
	ulLocal  = netip.MustParseAddr("10.99.0.1")
	ulPeer   = netip.MustParseAddr("10.99.0.2")
	ulOther  = netip.MustParseAddr("10.99.0.3")
)

const (
	protoICMP = 1
	protoTCP  = 6
	protoUDP  = 17

	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpPSH = 0x08
	tcpACK = 0x10
)

func eth(dst, src net.HardwareAddr, typ uint16, payload []byte) []byte {
	b := append(append([]byte{}, dst...), src...)
	b = binary.BigEndian.AppendUint16(b, typ)
	return append(b, payload...)
}

type ipOpts struct {
	tos, ttl byte
	options  []byte // makes IHL > 5
	frag     uint16 // flags+offset field
	id       uint16
}

func csum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

func ipv4(o ipOpts, proto byte, src, dst netip.Addr, payload []byte) []byte {
	if o.ttl == 0 {
		o.ttl = 64
	}
	hl := 20 + len(o.options)
	h := make([]byte, hl)
	h[0] = 0x40 | byte(hl/4)
	h[1] = o.tos
	binary.BigEndian.PutUint16(h[2:], uint16(hl+len(payload)))
	binary.BigEndian.PutUint16(h[4:], o.id)
	binary.BigEndian.PutUint16(h[6:], o.frag)
	h[8], h[9] = o.ttl, proto
	s, d := src.As4(), dst.As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	copy(h[20:], o.options)
	binary.BigEndian.PutUint16(h[10:], csum(h))
	return append(h, payload...)
}

func tcp(sport, dport uint16, flags byte, payload []byte) []byte {
	h := make([]byte, 20)
	binary.BigEndian.PutUint16(h[0:], sport)
	binary.BigEndian.PutUint16(h[2:], dport)
	binary.BigEndian.PutUint32(h[4:], 1000)
	binary.BigEndian.PutUint32(h[8:], 2000)
	h[12] = 5 << 4
	h[13] = flags
	binary.BigEndian.PutUint16(h[14:], 65535)
	return append(h, payload...)
}

func udp(sport, dport uint16, payload []byte) []byte {
	h := make([]byte, 8)
	binary.BigEndian.PutUint16(h[0:], sport)
	binary.BigEndian.PutUint16(h[2:], dport)
	binary.BigEndian.PutUint16(h[4:], uint16(8+len(payload)))
	return append(h, payload...)
}

func icmp(typ byte, payload []byte) []byte {
	h := []byte{typ, 0, 0, 0, 0, 1, 0, 1}
	return append(h, payload...)
}

// vxlan wraps an inner frame the way the overlay's VXLAN device does.
func vxlan(outer ipOpts, srcMAC, dstMAC net.HardwareAddr, src, dst netip.Addr, vni uint32, dport uint16, inner []byte) []byte {
	vx := []byte{0x08, 0, 0, 0, byte(vni >> 16), byte(vni >> 8), byte(vni), 0}
	return eth(dstMAC, srcMAC, 0x0800, ipv4(outer, protoUDP, src, dst, udp(50000, dport, append(vx, inner...))))
}

var payload = []byte("skiff golden packet payload")

// A container-to-remote-container TCP data segment, as from_container sees it.
func egressTCP(o ipOpts, flags byte) []byte {
	return eth(macBridge, macContainer, 0x0800, ipv4(o, protoTCP, ipLocal, ipRemote, tcp(40000, 80, flags, payload)))
}

// The same segment's reply, encapsulated by the remote host's overlay.
func ingressTCP(o ipOpts, flags byte) []byte {
	inner := eth(macVTEP, macPeerVTEP, 0x0800, ipv4(o, protoTCP, ipRemote, ipLocal, tcp(80, 40000, flags, payload)))
	return vxlan(ipOpts{}, macPeer, macUnderlay, ulPeer, ulLocal, testVNI, 4789, inner)
}

// The outgoing segment after the local overlay encapsulated it.
func encapsulatedTCP(o ipOpts) []byte {
	inner := eth(macPeerVTEP, macVTEP, 0x0800, ipv4(o, protoTCP, ipLocal, ipRemote, tcp(40000, 80, tcpACK, payload)))
	return vxlan(ipOpts{ttl: 64, frag: 0x4000}, macUnderlay, macPeer, ulLocal, ulPeer, testVNI, 4789, inner)
}
