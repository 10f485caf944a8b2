package cache

import (
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/overlay"
)

// The outer headers towards a remote host, built from the cluster's record
// of it and this host's routes and neighbours: the headers the overlay's
// VXLAN device puts in front of a packet to that host (outer Ethernet,
// IPv4, UDP, VXLAN, inner Ethernet), so that a connection's first packet
// can take the fast path. to_underlay learns the same headers from the
// overlay's packets, for hosts whose next hop was not resolved yet.

// headerParams is what one host's headers are made of.
type headerParams struct {
	NextHop, Underlay  net.HardwareAddr // outer Ethernet destination, source
	Src, Dst           netip.Addr       // the two hosts' underlay addresses
	TTL                uint8
	Port               uint16 // VXLAN UDP port
	VNI                uint32
	InnerDst, InnerSrc net.HardwareAddr // the VTEPs' MACs
}

// vxlanHeader lays out the 64 bytes of struct egress_host's hdr. Lengths,
// the IP ID and checksum and the UDP source port are the program's to fill
// per packet; the UDP checksum stays zero, as the overlay device sends it.
func vxlanHeader(p headerParams) [64]byte {
	var h [64]byte
	copy(h[0:6], p.NextHop)
	copy(h[6:12], p.Underlay)
	binary.BigEndian.PutUint16(h[12:14], 0x0800)
	ip := h[14:34]
	ip[0] = 0x45
	ip[8] = p.TTL
	ip[9] = 17 // UDP
	src, dst := p.Src.As4(), p.Dst.As4()
	copy(ip[12:16], src[:])
	copy(ip[16:20], dst[:])
	binary.BigEndian.PutUint16(h[36:38], p.Port)
	h[42] = 0x08 // VXLAN: a valid VNI follows
	h[46], h[47], h[48] = byte(p.VNI>>16), byte(p.VNI>>8), byte(p.VNI)
	copy(h[50:56], p.InnerDst)
	copy(h[56:62], p.InnerSrc)
	binary.BigEndian.PutUint16(h[62:64], 0x0800)
	return h
}

// putHeaders writes the headers of every remote host whose next hop this
// host has resolved and that the underlay device reaches; the others are
// learned from the overlay's first packet to them, as before. Called at
// every cluster change with the remote hosts (kept for refreshHeaders).
func (c *fastPath) putHeaders(remote []cluster.Host) {
	c.remote.Lock()
	c.remote.hosts = remote
	c.remote.Unlock()
	c.writeHeaders(remote)
}

// refreshHeaders writes the last remote hosts' headers again: a next hop
// resolved since, or one whose MAC changed (connections in the table send
// nothing through the overlay to learn it from).
func (c *fastPath) refreshHeaders() {
	c.remote.Lock()
	remote := c.remote.hosts
	c.remote.Unlock()
	c.writeHeaders(remote)
}

func (c *fastPath) writeHeaders(remote []cluster.Host) {
	ttl := defaultTTL()
	for _, h := range remote {
		mac, err := net.ParseMAC(h.VTEPMAC)
		if err != nil {
			continue
		}
		next, ifindex, ok := c.nextHop(h.UnderlayIP)
		if !ok {
			continue
		}
		eh := skcEgressHost{Ifindex: uint32(ifindex), Hdr: vxlanHeader(headerParams{
			NextHop: next, Underlay: c.underlay.Attrs().HardwareAddr,
			Src: c.cfg.Host.UnderlayIP, Dst: h.UnderlayIP, TTL: ttl,
			Port: uint16(c.cfg.Cluster.VXLANPort), VNI: uint32(c.cfg.Cluster.VNI),
			InnerDst: mac, InnerSrc: overlay.VTEPMAC(c.cfg.Host.UnderlayIP),
		})}
		var have skcEgressHost
		key := h.UnderlayIP.As4()
		if err := c.objs.SkcEgressHost.Lookup(key, &have); err == nil && have == eh {
			continue
		}
		if err := c.objs.SkcEgressHost.Put(key, eh); err != nil {
			c.log.Warn("egress headers", "host", h.Name, "err", err)
		}
	}
}

// nextHop is the MAC the underlay device sends dst's packets to, when the
// route to dst leaves through it and the neighbour is resolved.
func (c *fastPath) nextHop(dst netip.Addr) (net.HardwareAddr, int, bool) {
	routes, err := netlink.RouteGet(dst.AsSlice())
	if err != nil || len(routes) == 0 {
		return nil, 0, false
	}
	r := routes[0]
	if r.LinkIndex != c.underlay.Attrs().Index {
		return nil, 0, false
	}
	via := dst.AsSlice()
	if r.Gw != nil {
		via = r.Gw
	}
	neighs, err := netlink.NeighList(r.LinkIndex, netlink.FAMILY_V4)
	if err != nil {
		return nil, 0, false
	}
	const usable = netlink.NUD_REACHABLE | netlink.NUD_STALE | netlink.NUD_DELAY | netlink.NUD_PROBE | netlink.NUD_PERMANENT
	for _, n := range neighs {
		if n.IP.Equal(via) && n.State&usable != 0 && len(n.HardwareAddr) == 6 {
			return n.HardwareAddr, r.LinkIndex, true
		}
	}
	return nil, 0, false
}

// defaultTTL is the outer TTL the overlay device sends with (it has none
// configured: the namespace's default).
func defaultTTL() uint8 {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_default_ttl")
	if err != nil {
		return 64
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 1 || n > 255 {
		return 64
	}
	return uint8(n)
}
