package cache

import (
	"net"
	"net/netip"

	"github.com/skiffnet/skiff/tc/tctest"
)

// Packet builders for the golden-packet tests: just enough Ethernet, IPv4,
// TCP/UDP/ICMP and VXLAN to write the cases down readably.

var (
	macContainer  = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0c}
	macContainer2 = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0d}
	macBridge     = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0b}
	macUnderlay   = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x01} // this host's underlay
	macPeer       = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x02} // remote host's underlay
	macVTEP       = net.HardwareAddr{0x0e, 0x5f, 10, 99, 0, 1}
	macPeerVTEP   = net.HardwareAddr{0x0e, 0x5f, 10, 99, 0, 2}

	ipLocal  = netip.MustParseAddr("10.244.1.5") // container on this host
	ipLocal2 = netip.MustParseAddr("10.244.1.6")
	ipRemote = netip.MustParseAddr("10.244.2.7") // container on the remote host
	ulLocal  = netip.MustParseAddr("10.99.0.1")
	ulPeer   = netip.MustParseAddr("10.99.0.2")
	ulOther  = netip.MustParseAddr("10.99.0.3")
)

var payload = []byte("skiff golden packet payload")

// A container-to-remote-container TCP data segment, as from_container sees it.
func egressTCP(o tctest.IPOpts, flags byte) []byte {
	return tctest.Eth(macBridge, macContainer, 0x0800, tctest.IPv4(o, tctest.ProtoTCP, ipLocal, ipRemote, tctest.TCP(40000, 80, flags, payload)))
}

// The same segment's reply, encapsulated by the remote host's overlay.
func ingressTCP(o tctest.IPOpts, flags byte) []byte {
	inner := tctest.Eth(macVTEP, macPeerVTEP, 0x0800, tctest.IPv4(o, tctest.ProtoTCP, ipRemote, ipLocal, tctest.TCP(80, 40000, flags, payload)))
	return tctest.VXLAN(tctest.IPOpts{}, macPeer, macUnderlay, ulPeer, ulLocal, testVNI, 4789, inner)
}

// The outgoing segment after the local overlay encapsulated it.
func encapsulatedTCP(o tctest.IPOpts) []byte {
	inner := tctest.Eth(macPeerVTEP, macVTEP, 0x0800, tctest.IPv4(o, tctest.ProtoTCP, ipLocal, ipRemote, tctest.TCP(40000, 80, tctest.ACK, payload)))
	return tctest.VXLAN(tctest.IPOpts{TTL: 64, Frag: 0x4000}, macUnderlay, macPeer, ulLocal, ulPeer, testVNI, 4789, inner)
}
