package sockets

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
)

func portOf(v uint16) uint16 { return bpfmap.Port(v) } // the swap is its own inverse

// LocalListeners lists this host's replaced listeners.
func (l *dataPlane) LocalListeners() ([]cluster.Listener, error) {
	var out []cluster.Listener
	var k sksSksKey
	it := l.objs.SksListen.Iterate()
	var cookie uint64
	for it.Next(&k, &cookie) {
		out = append(out, cluster.Listener{Host: l.cfg.Host.Name, Addr: netip.AddrPortFrom(bpfmap.Addr(k.Ip), portOf(k.Port))})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("list listeners: %w", err)
	}
	slices.SortFunc(out, func(a, b cluster.Listener) int { return a.Addr.Compare(b.Addr) })
	return out, nil
}

// Sync makes the maps match the cluster: which host owns which subnet
// (anti-spoofing), where each published listener lives, and the policy
// connect4 judges fast-path connections by. The policy is written first, so
// a new route is only ever taken under the policy in force.
func (l *dataPlane) Sync(hosts []cluster.Host, listeners []cluster.Listener, rules policy.Set) error {
	subnets := map[sksSksSubnet]uint32{}
	underlay := map[string]netip.Addr{}
	for _, h := range hosts {
		underlay[h.Name] = h.UnderlayIP
		if h.Subnet.IsValid() {
			subnets[sksSksSubnet{Prefixlen: uint32(h.Subnet.Bits()), Ip: bpfmap.IPv4(h.Subnet.Masked().Addr())}] = bpfmap.IPv4(h.UnderlayIP)
		}
	}
	var routed []cluster.Listener
	for _, li := range listeners {
		if _, ok := underlay[li.Host]; ok { // a departed host's listeners are gone
			routed = append(routed, li)
		}
	}
	routed, over := fairShare(routed, int(l.objs.SksRoutes.MaxEntries()))
	if int64(over) != l.routesOver.Swap(int64(over)) {
		if over > 0 {
			l.log.Warn("more published listeners than the fast path routes: each container gets an equal share, the rest take the overlay",
				"over", over, "capacity", l.objs.SksRoutes.MaxEntries())
		}
	}
	routes := make(map[sksSksKey]uint32, len(routed))
	for _, li := range routed {
		routes[sksSksKey{Ip: bpfmap.IPv4(li.Addr.Addr()), Port: bpfmap.Port(li.Addr.Port())}] = bpfmap.IPv4(underlay[li.Host])
	}
	return errors.Join(l.setPolicy(rules), syncMap(l.objs.SksSubnets, subnets), syncMap(l.objs.SksRoutes, routes))
}

// fairShare keeps at most capacity of the listeners, sharing them equally
// among the containers (overlay addresses) that have more than their
// share, so that no container's listeners leave the others no route; a
// container keeps its lowest ports. It returns those kept and how many
// were not.
func fairShare(ls []cluster.Listener, capacity int) ([]cluster.Listener, int) {
	if len(ls) <= capacity {
		return ls, 0
	}
	byAddr := map[netip.Addr][]cluster.Listener{}
	for _, li := range ls {
		byAddr[li.Addr.Addr()] = append(byAddr[li.Addr.Addr()], li)
	}
	groups := slices.Collect(maps.Values(byAddr))
	// Smallest first: each takes what it has up to an equal share of what
	// is left, and leaves the rest to the larger ones.
	slices.SortFunc(groups, func(a, b []cluster.Listener) int {
		return cmp.Or(cmp.Compare(len(a), len(b)), a[0].Addr.Addr().Compare(b[0].Addr.Addr()))
	})
	kept, left := make([]cluster.Listener, 0, capacity), capacity
	for i, g := range groups {
		n := min(len(g), left/(len(groups)-i))
		slices.SortFunc(g, func(a, b cluster.Listener) int { return cmp.Compare(a.Addr.Port(), b.Addr.Port()) })
		kept = append(kept, g[:n]...)
		left -= n
	}
	return kept, len(ls) - len(kept)
}

// tcpRules renders the rules that can match a TCP connection in connect4's
// form, in evaluation order. Past maxRules it sets Overflow instead.
func tcpRules(rules policy.Set) *sksSksRules {
	var out sksSksRules
	for _, r := range rules {
		if r.Proto != "" && r.Proto != policy.TCP {
			continue
		}
		for _, b := range portBlocks(r.Port, r.LastPort()) {
			if int(out.N) == len(out.Rules) {
				out.Overflow = 1
				return &out
			}
			k := &out.Rules[out.N]
			k.Src, k.SrcMask = prefix32(r.Src)
			k.Dst, k.DstMask = prefix32(r.Dst)
			k.Port, k.PortMask = bpfmap.Port(b.port), bpfmap.Port(b.mask)
			if r.Action == policy.Allow {
				k.Allow = 1
			}
			out.N++
		}
	}
	return &out
}

// portBlock is the ports p with p&mask == port.
type portBlock struct{ port, mask uint16 }

// portBlocks covers first..last with aligned blocks, the fewest there are
// (at most 30), the form connect4's masked match takes; first 0 is any
// port, one block with mask 0.
func portBlocks(first, last uint16) []portBlock {
	if first == 0 {
		return []portBlock{{0, 0}}
	}
	var out []portBlock
	for p := uint32(first); p <= uint32(last); {
		size := uint32(1)
		for p%(size*2) == 0 && p+size*2-1 <= uint32(last) {
			size *= 2
		}
		out = append(out, portBlock{uint16(p), uint16(^(size - 1))})
		p += size
	}
	return out
}

// prefix32 is a prefix as connect4 matches it: address and mask in network
// order; the zero prefix (any) has mask 0.
func prefix32(p netip.Prefix) (ip, mask32 uint32) {
	if !p.IsValid() {
		return 0, 0
	}
	m := mask(p)
	return bpfmap.IPv4(p.Masked().Addr()), binary.NativeEndian.Uint32(m[:])
}

// setPolicy puts the rules in force for new fast-path connections: in a new
// inner map swapped into sks_policy in one step. On failure it empties the
// slot, and connect4 then refuses every connection (the overlay judges).
func (l *dataPlane) setPolicy(rules policy.Set) error {
	want := tcpRules(rules)
	if l.policy != nil && *l.policy == *want {
		return nil
	}
	err := l.swapPolicy(want)
	if err != nil {
		if derr := l.objs.SksPolicy.Delete(uint32(0)); derr != nil && !errors.Is(derr, ebpf.ErrKeyNotExist) {
			err = errors.Join(err, fmt.Errorf("empty the fast path's policy: %w", derr))
		}
		l.policy = nil
		return err
	}
	l.policy = want
	if want.Overflow != 0 {
		l.log.Warn("the policy has more TCP rules than the fast path judges: every connection takes the overlay",
			"limit", len(want.Rules))
	}
	return nil
}

// Policy is the policy connect4 judges new connections by.
type Policy struct {
	Rules    int  `json:"rules"`    // the rules it reads: those that can match TCP
	Overflow bool `json:"overflow"` // more than it takes: every connection takes the overlay
}

// PolicyInForce reports the policy in force, nil while there is none (when
// connect4 refuses every connection).
func (l *dataPlane) PolicyInForce() (*Policy, error) {
	r, err := l.inForce()
	if err != nil || r == nil {
		return nil, err
	}
	return &Policy{Rules: int(r.N), Overflow: r.Overflow != 0}, nil
}

func (l *dataPlane) inForce() (*sksSksRules, error) {
	var id ebpf.MapID
	if err := l.objs.SksPolicy.Lookup(uint32(0), &id); errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, fmt.Errorf("read policy: %w", err)
	}
	inner, err := ebpf.NewMapFromID(id)
	if err != nil {
		return nil, fmt.Errorf("read policy: %w", err)
	}
	defer inner.Close()
	var r sksSksRules
	if err := inner.Lookup(uint32(0), &r); err != nil {
		return nil, fmt.Errorf("read policy: %w", err)
	}
	return &r, nil
}

func (l *dataPlane) swapPolicy(r *sksSksRules) error {
	inner, err := ebpf.NewMap(l.rulesSpec)
	if err != nil {
		return fmt.Errorf("policy map: %w", err)
	}
	defer inner.Close() // sks_policy keeps its own reference
	if err := inner.Put(uint32(0), r); err != nil {
		return fmt.Errorf("write policy: %w", err)
	}
	if err := l.objs.SksPolicy.Put(uint32(0), inner); err != nil {
		return fmt.Errorf("swap in policy: %w", err)
	}
	return nil
}

// syncMap makes m hold exactly want. Failed updates (a full map) are
// reported once, with how many there were.
func syncMap[K comparable](m *ebpf.Map, want map[K]uint32) error {
	have, err := bpfmap.Entries[K, uint32](m)
	if err != nil {
		return err
	}
	var stale []K
	for k := range have {
		if _, ok := want[k]; !ok {
			stale = append(stale, k)
		}
	}
	_, derr := bpfmap.Delete(m, stale)
	failed, first := 0, error(nil)
	for k, v := range want {
		if w, ok := have[k]; ok && w == v {
			continue // already right
		}
		if err := m.Put(k, v); err != nil {
			if failed == 0 {
				first = err
			}
			failed++
		}
	}
	if failed > 0 {
		return errors.Join(derr, fmt.Errorf("update %s: %d entries failed, the first with: %w", m, failed, first))
	}
	return derr
}

// WatchListeners signals on the returned channel whenever a replaced
// listener appears or goes away on this host, until ctx ends. Listeners
// exposed on host addresses are ended as soon as they are reported; when
// the programs found the event buffer full (event_lost), a sweep every 5 s
// ends what they could not report, and the listeners are published again.
func (l *dataPlane) WatchListeners(ctx context.Context) (<-chan struct{}, error) {
	rd, err := ringbuf.NewReader(l.objs.SksEvents)
	if err != nil {
		return nil, fmt.Errorf("listener events: %w", err)
	}
	go func() {
		<-ctx.Done()
		rd.Close()
	}()
	kinds := make(chan sksSksEventKind)
	go func() {
		defer close(kinds)
		for {
			rec, err := rd.Read()
			if errors.Is(err, ringbuf.ErrClosed) {
				return
			}
			if err != nil {
				l.log.Warn("listener events", "err", err)
				time.Sleep(100 * time.Millisecond)
				continue
			}
			var ev sksSksEvent
			if binary.Read(bytes.NewReader(rec.RawSample), binary.NativeEndian, &ev) == nil {
				kinds <- sksSksEventKind(ev.Kind)
			}
		}
	}()
	out := make(chan struct{}, 1)
	go func() {
		defer close(out)
		t := time.NewTicker(5 * time.Second)
		defer t.Stop()
		lost := l.eventsLost()
		for {
			select {
			case kind, ok := <-kinds:
				if !ok {
					return
				}
				if kind == sksSksEventKindSKS_EV_EXPOSED {
					l.endExposedNow()
					continue
				}
			case <-t.C:
				n := l.eventsLost()
				if n == lost {
					continue
				}
				lost = n
				l.endExposedNow()
			}
			select {
			case out <- struct{}{}:
			default: // one pending signal is enough
			}
		}
	}()
	return out, nil
}

// eventsLost reads the event_lost counter.
func (l *dataPlane) eventsLost() uint64 {
	st, _ := l.Stats()
	return st["event_lost"]
}

// endExposedNow ends exposed listeners, and logs it.
func (l *dataPlane) endExposedNow() {
	if n, err := l.endExposed(); err != nil {
		l.log.Warn("end exposed listeners", "err", err)
	} else if n > 0 {
		l.log.Warn("ended listeners a container opened on a host address (listen without bind)", "sockets", n)
	}
}
