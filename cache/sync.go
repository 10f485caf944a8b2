package cache

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
)

func addr(b [4]byte) netip.Addr { return netip.AddrFrom4(b) }

// addr32 and be32 convert between addresses and the uint32 bpf2go uses for
// __be32 (network-order bytes read as a little-endian integer).
func addr32(v uint32) netip.Addr {
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

func be32(a netip.Addr) uint32 {
	b := a.As4()
	return binary.LittleEndian.Uint32(b[:])
}

// purgeFlows deletes filter entries match selects.
func (c *fastPath) purgeFlows(match func(skcFlowKey) bool) (int, error) {
	return purge(c.objs.SkcFilter, func(k skcFlowKey, _ skcFilterVal) bool { return match(k) })
}

// purge deletes m's entries stale selects.
func purge[K comparable, V any](m *ebpf.Map, stale func(K, V) bool) (int, error) {
	all, err := bpfmap.Entries[K, V](m)
	if err != nil {
		return 0, err
	}
	var doomed []K
	for k, v := range all {
		if stale(k, v) {
			doomed = append(doomed, k)
		}
	}
	return bpfmap.Delete(m, doomed)
}

var protoNames = map[uint8]string{6: policy.TCP, 17: policy.UDP, 1: policy.ICMP}

func ntohs(v uint16) uint16 { return v>>8 | v<<8 }

// deniedBy reports whether set denies the cached flow in either direction
// (the cache does not know which side opened it).
func deniedBy(set policy.Set, k skcFlowKey) bool {
	proto := protoNames[k.Proto]
	l, r := addr32(k.Laddr), addr32(k.Raddr)
	var lport, rport uint16
	if proto == policy.TCP || proto == policy.UDP {
		lport, rport = ntohs(k.Lport), ntohs(k.Rport)
	}
	return !set.Allowed(policy.Flow{Src: l, Dst: r, Proto: proto, Port: rport}) ||
		!set.Allowed(policy.Flow{Src: r, Dst: l, Proto: proto, Port: lport})
}

// PurgeDenied deletes the cached flows and the table's connections set
// denies, so their next packets go to the overlay, where the policy chain
// judges them.
func (c *fastPath) PurgeDenied(set policy.Set) (int, error) {
	n, err1 := c.purgeFlows(func(k skcFlowKey) bool { return deniedBy(set, k) })
	m, err2 := c.purgeConnections(func(k skcFlowKey, s skcFlowState) bool { return openedAgainst(set, k, s) })
	return n + m, errors.Join(err1, err2)
}

// Sync makes the caches agree with the cluster: egress entries name every
// live remote endpoint (and host VTEP) with the host that owns it now,
// egress headers every live remote host, ingress entries local endpoints
// only, and flows addresses that still exist. This covers endpoint
// deletion, host removal and host moves (delete-and-reinitialize, paper
// §3.4) on every host, and it is what lets a connection's first SYN take
// the fast path: its destination is known before any packet was sent.
func (c *fastPath) Sync(endpoints []cluster.Endpoint, hosts []cluster.Host) error {
	underlay := map[string]netip.Addr{}
	var remote []cluster.Host
	owner := map[netip.Addr]netip.Addr{} // overlay address → host underlay address
	for _, h := range hosts {
		underlay[h.Name] = h.UnderlayIP
		if h.Name != c.cfg.Host.Name {
			remote = append(remote, h)
		}
		if h.Subnet.IsValid() {
			owner[h.Subnet.Masked().Addr()] = h.UnderlayIP // its VTEP address
		}
	}
	local := map[netip.Addr]bool{}
	for _, e := range endpoints {
		if ul, ok := underlay[e.Host]; ok {
			owner[e.IP.Addr()] = ul
		}
		if e.Host == c.cfg.Host.Name {
			local[e.IP.Addr()] = true
		}
	}
	liveHost := map[netip.Addr]bool{}
	for _, h := range remote {
		liveHost[h.UnderlayIP] = true
	}
	var errs []error
	// Egress level 1: remote container → host, every one of them.
	errs = append(errs, c.syncEgressIPs(owner, liveHost))
	// Egress level 2: host → headers.
	_, err := purge(c.objs.SkcEgressHost, func(host [4]byte, _ skcEgressHost) bool { return !liveHost[addr(host)] })
	errs = append(errs, err)
	c.putHeaders(remote)
	// Ingress: local containers only.
	_, err = purge(c.objs.SkcIngress, func(ip [4]byte, _ skcIngressEp) bool { return !local[addr(ip)] })
	errs = append(errs, err)
	// Flows and connections between addresses that no longer both exist.
	gone := func(k skcFlowKey) bool {
		_, r := owner[addr32(k.Raddr)]
		return !local[addr32(k.Laddr)] || !r
	}
	_, err = c.purgeFlows(gone)
	errs = append(errs, err)
	_, err = c.purgeConnections(func(k skcFlowKey, _ skcFlowState) bool { return gone(k) })
	errs = append(errs, err, c.syncTunnel(hosts, owner, local))
	return errors.Join(errs...)
}

// syncEgressIPs makes skc_egress_ip name every remote address of owner
// with its host, writing only what differs.
func (c *fastPath) syncEgressIPs(owner map[netip.Addr]netip.Addr, remote map[netip.Addr]bool) error {
	have, err := bpfmap.Entries[[4]byte, [4]byte](c.objs.SkcEgressIp)
	if err != nil {
		return err
	}
	var doomed [][4]byte
	for ip, host := range have {
		if h, ok := owner[addr(ip)]; !ok || h != addr(host) {
			doomed = append(doomed, ip)
		}
	}
	deleted, err := bpfmap.Delete(c.objs.SkcEgressIp, doomed)
	errs := []error{err}
	// Never more than fits: an LRU map takes every Put by evicting, and
	// preloading more than its size would evict, at every sync, the
	// entries flows are using. What does not fit the programs learn from
	// the overlay's packets as flows start.
	room, unloaded := int(c.cfg.Capacity.EgressIPs)-(len(have)-deleted), 0
	for ip, host := range owner {
		if !remote[host] {
			continue
		}
		if h, ok := have[ip.As4()]; ok && addr(h) == host {
			continue
		}
		if room <= 0 {
			unloaded++
			continue
		}
		if err := c.objs.SkcEgressIp.Put(ip.As4(), host.As4()); err != nil {
			errs = append(errs, fmt.Errorf("egress entry %s: %w", ip, err))
		}
		room--
	}
	if unloaded != c.unloaded {
		c.unloaded = unloaded
		if unloaded > 0 {
			c.log.Warn("remote addresses beyond the egress map's capacity: their first packets take the overlay until the cache learns them (--cache-capacity)",
				"unloaded", unloaded, "capacity", c.cfg.Capacity.EgressIPs)
		}
	}
	return errors.Join(errs...)
}

// Stats sums the per-CPU counters by reason.
func (c *fastPath) Stats() (map[string]uint64, error) {
	sums, err := bpfmap.Counters(c.objs.SkcStats, len(Reasons))
	if err != nil {
		return nil, err
	}
	out := make(map[string]uint64, len(Reasons))
	for i, r := range Reasons {
		out[r.Name] = sums[i]
	}
	return out, nil
}
