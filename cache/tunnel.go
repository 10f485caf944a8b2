package cache

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/overlay"
)

// The rewriting tunnel (tunnel.h): what the agent keeps coherent of it.

// Tunnels the cache sends its fast-path packets in (--cache-tunnel).
const (
	TunnelVXLAN   = "vxlan"   // VXLAN headers the overlay's device would have built
	TunnelRewrite = "rewrite" // ONCache-t: the packet's own headers rewritten, a restore key in its IPv4 ID
)

// FeatureRewrite is what a host in rewrite mode announces in its record
// (cluster.Host.Features): its cache restores rewritten packets.
const FeatureRewrite = "cache-rewrite"

// RewriteMark is the skb mark of a rewritten packet (RW_MARK in tunnel.h).
const RewriteMark = 0x5c1fd

// deadKeyLife is how long a key stays dead after the last packet that
// carried it before it is freed for another pair: a sender stops using a
// key 5 s (RW_HEARD_NS) after it last heard from the pair.
const deadKeyLife = 60 * time.Second

func (c *fastPath) rewriting() bool { return c.cfg.Tunnel == TunnelRewrite }

// setVXLAN tells the programs the overlay's VXLAN device, where restored
// packets the fast path does not carry go (it may have been re-created).
func (c *fastPath) setVXLAN() error {
	if !c.rewriting() {
		return nil
	}
	l, err := netlink.LinkByName(overlay.VXLANName)
	if err != nil {
		return fmt.Errorf("the overlay's VXLAN device: %w", err)
	}
	if c.ctl.Vxlan == uint32(l.Attrs().Index) {
		return nil
	}
	c.ctl.Vxlan = uint32(l.Attrs().Index)
	if err := c.objs.SkcControl.Put(uint32(0), c.ctl); err != nil {
		return fmt.Errorf("set the VXLAN device: %w", err)
	}
	return nil
}

// syncTunnel makes the tunnel's maps agree with the cluster: peers are the
// live remote hosts that announce the tunnel (in either tunnel: the scrub
// needs them); a pair goes when either container has gone or its remote
// one lives on no peer now (every pair, unless this host rewrites); a key
// dies when its pair does, or its peer stops announcing. owner maps every
// live address to its host's underlay address.
func (c *fastPath) syncTunnel(hosts []cluster.Host, owner map[netip.Addr]netip.Addr, local map[netip.Addr]bool) error {
	peers, rewriteTo := map[netip.Addr]bool{}, map[netip.Addr]bool{}
	for _, h := range hosts {
		if h.Name != c.cfg.Host.Name && slices.Contains(h.Features, FeatureRewrite) {
			peers[h.UnderlayIP] = true
			if c.rewriting() {
				rewriteTo[h.UnderlayIP] = true
			}
		}
	}
	var errs []error
	_, err := purge(c.objs.SkcPeers, func(h [4]byte, _ uint32) bool { return !peers[addr(h)] })
	errs = append(errs, err)
	for h := range peers {
		if err := c.objs.SkcPeers.Put(h.As4(), uint32(1)); err != nil {
			errs = append(errs, fmt.Errorf("tunnel peer %s: %w", h, err))
		}
	}
	_, err = purge(c.objs.SkcRwPairs, func(k skcRwPairKey, _ skcRwPair) bool {
		return !local[addr32(k.Local)] || !rewriteTo[owner[addr32(k.Remote)]]
	})
	errs = append(errs, err)
	errs = append(errs, c.killKeys(func(k skcRwKeyKey, v skcRwKey) bool {
		return !rewriteTo[addr32(k.Peer)] || !local[addr32(v.Local)] || owner[addr32(v.Remote)] != addr32(k.Peer)
	}))
	return errors.Join(errs...)
}

// forgetTunnel drops a local container's pairs and kills its keys.
func (c *fastPath) forgetTunnel(ip uint32) error {
	_, err := purge(c.objs.SkcRwPairs, func(k skcRwPairKey, _ skcRwPair) bool { return k.Local == ip })
	return errors.Join(err, c.killKeys(func(_ skcRwKeyKey, v skcRwKey) bool { return v.Local == ip }))
}

// killKeys marks the live keys doomed selects dead: their packets are
// dropped from now on, and the key is not given again for deadKeyLife.
func (c *fastPath) killKeys(doomed func(skcRwKeyKey, skcRwKey) bool) error {
	all, err := bpfmap.Entries[skcRwKeyKey, skcRwKey](c.objs.SkcRwKeys)
	if err != nil {
		return err
	}
	now, err := monotonicCoarse()
	if err != nil {
		return err
	}
	var errs []error
	for k, v := range all {
		if v.Dead != 0 || !doomed(k, v) {
			continue
		}
		v.Dead, v.Seen = 1, now
		if err := c.objs.SkcRwKeys.Put(k, v); err != nil {
			errs = append(errs, fmt.Errorf("kill tunnel key %d of %s: %w", k.Key, addr32(k.Peer), err))
		}
	}
	return errors.Join(errs...)
}

// sweepKeys kills the live keys no pair holds (an evicted pair, a lost
// race of two allocations) and frees the keys dead for deadKeyLife.
func (c *fastPath) sweepKeys() (int, error) {
	pairs, err := bpfmap.Entries[skcRwPairKey, skcRwPair](c.objs.SkcRwPairs)
	if err != nil {
		return 0, err
	}
	err = c.killKeys(func(k skcRwKeyKey, v skcRwKey) bool {
		p, ok := pairs[skcRwPairKey{Local: v.Local, Remote: v.Remote}]
		return !ok || p.Recv != k.Key
	})
	now, err2 := monotonicCoarse()
	if err := errors.Join(err, err2); err != nil {
		return 0, err
	}
	return purge(c.objs.SkcRwKeys, func(_ skcRwKeyKey, v skcRwKey) bool {
		return v.Dead != 0 && v.Seen < now && time.Duration(now-v.Seen) > deadKeyLife
	})
}

// TunnelPair is one pair of the rewriting tunnel (skiff layer cache).
type TunnelPair struct {
	Local, Remote netip.Addr
	Send, Recv    uint16 // the peer's key for this host's packets, this host's for the peer's
	Pending       bool   // Recv not acknowledged yet
}

// TunnelKey is a key this host gave a peer.
type TunnelKey struct {
	Peer          netip.Addr
	Key           uint16
	Remote, Local netip.Addr
	Dead          bool
}

// tunnelEntries lists the tunnel's pairs and keys.
func (c *fastPath) tunnelEntries() ([]TunnelPair, []TunnelKey, error) {
	pairs, err1 := bpfmap.Entries[skcRwPairKey, skcRwPair](c.objs.SkcRwPairs)
	keys, err2 := bpfmap.Entries[skcRwKeyKey, skcRwKey](c.objs.SkcRwKeys)
	if err := errors.Join(err1, err2); err != nil {
		return nil, nil, err
	}
	var ps []TunnelPair
	for k, v := range pairs {
		ps = append(ps, TunnelPair{Local: addr32(k.Local), Remote: addr32(k.Remote), Send: v.Send, Recv: v.Recv, Pending: v.Pending != 0})
	}
	var ks []TunnelKey
	for k, v := range keys {
		ks = append(ks, TunnelKey{Peer: addr32(k.Peer), Key: k.Key, Remote: addr32(v.Remote), Local: addr32(v.Local), Dead: v.Dead != 0})
	}
	slices.SortFunc(ps, func(a, b TunnelPair) int {
		if c := a.Local.Compare(b.Local); c != 0 {
			return c
		}
		return a.Remote.Compare(b.Remote)
	})
	slices.SortFunc(ks, func(a, b TunnelKey) int {
		if c := a.Peer.Compare(b.Peer); c != 0 {
			return c
		}
		return int(a.Key) - int(b.Key)
	})
	return ps, ks, nil
}
