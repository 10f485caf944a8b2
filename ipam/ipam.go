// Package ipam hands out overlay addresses: the cluster CIDR is cut into
// per-host subnets, and each host's containers get addresses from its subnet.
// A host writes only keys of its own: its claim on a subnet (the oldest
// claim holds it, so concurrent agents never hold the same subnet) and its
// address leases (etcd transactions, so an address is never handed out
// twice). Both are persisted, so they survive agent restarts.
package ipam

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/source"
	"github.com/skiffnet/skiff/store"
)

// ErrExhausted means no subnet or address is free.
var ErrExhausted = source.ErrExhausted

// ErrInUse means an address asked for is another container's.
var ErrInUse = source.ErrInUse

// ErrNotInSubnet means an address asked for is not one this host gives.
var ErrNotInSubnet = source.ErrNotInSubnet

// Subnets enumerates the host subnets of the cluster in address order.
func Subnets(c cluster.Config) []netip.Prefix {
	n := 1 << (c.HostPrefix - c.CIDR.Bits())
	out := make([]netip.Prefix, 0, n)
	a := c.CIDR.Masked().Addr()
	step := uint32(1) << (32 - c.HostPrefix)
	for i := 0; i < n; i++ {
		out = append(out, netip.PrefixFrom(a, c.HostPrefix))
		a = addU32(a, step)
	}
	return out
}

func addU32(a netip.Addr, n uint32) netip.Addr {
	b := a.As4()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	v += n
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// Join registers h in the cluster and returns it with its subnet. A host
// keeps the subnet it holds (its record's, else h.Subnet's, else any it
// claimed earlier and still holds; its underlay address and VTEP MAC are
// updated); a new host claims h.Subnet if that is set and free, else the
// first free subnet. A host writes only its own keys: it claims a subnet
// in its own prefix and holds it when its claim is the oldest
// (store.Holders), so two hosts racing for a subnet both see which won.
// Claims it does not use are withdrawn.
func Join(ctx context.Context, s *store.Store, c cluster.Config, h cluster.Host) (cluster.Host, error) {
	h, _, err := settle(ctx, s, c, h, false)
	return h, err
}

// settle makes the store hold h: a claim of h's that holds its subnet, its
// record naming that subnet, and no other claims of h's. It writes only
// what is missing or wrong, and says what that was. The subnet is h.Subnet
// when keep is set (ErrTaken when another host holds it), else as Join
// says. The one place that decides which subnet a host holds.
func settle(ctx context.Context, s *store.Store, c cluster.Config, h cluster.Host, keep bool) (cluster.Host, []string, error) {
	if err := store.ValidateHostName(h.Name); err != nil {
		return cluster.Host{}, nil, err
	}
	hostKey := store.HostKey(h.Name)
	var repaired []string
	for attempt := 0; attempt < 2*len(Subnets(c))+8; attempt++ {
		resp, err := s.Txn(ctx, nil, []clientv3.Op{clientv3.OpGet(hostKey), clientv3.OpGet(store.SubnetsPrefix, clientv3.WithPrefix())})
		if err != nil {
			return cluster.Host{}, nil, err
		}
		record := only(resp, 0)
		var have cluster.Host
		garbled := record != nil && json.Unmarshal(record.Value, &have) != nil
		var claims []store.Claim
		own := map[netip.Prefix]*mvccpb.KeyValue{} // h's claims
		for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
			if cl, ok := store.ParseClaim(kv); ok {
				claims = append(claims, cl)
				if cl.Host == h.Name {
					own[cl.Subnet] = kv
				}
			}
		}
		holders := store.Holders(claims)
		subnet, ok := h.Subnet, holders[h.Subnet].Host == h.Name
		if keep {
			if other := holders[subnet].Host; !ok && other != "" {
				return cluster.Host{}, nil, fmt.Errorf("subnet %s of %s: %w %s", subnet, h.Name, ErrTaken, other)
			}
		} else if subnet, ok = held(c, holders, h.Name, have.Subnet, h.Subnet); !ok {
			if subnet, err = freeSubnet(c, holders, h.Subnet); err != nil {
				return cluster.Host{}, nil, err
			}
		}
		if !ok {
			if err := claim(ctx, s, h.Name, subnet); err != nil {
				return cluster.Host{}, nil, err
			}
			repaired = append(repaired, "subnet claim (missing)")
			continue // see whose claim is the oldest
		}
		h.Subnet = subnet
		claimKey := store.ClaimKey(h.Name, subnet)
		var ops []clientv3.Op
		var fixed []string
		if record == nil || garbled || !have.Equal(h) {
			val, _ := json.Marshal(h)
			ops = append(ops, clientv3.OpPut(hostKey, string(val)))
			fixed = append(fixed, "host record "+damage(record))
		}
		if string(own[subnet].Value) != h.Name {
			// A put keeps the claim's create revision: it still holds.
			ops = append(ops, clientv3.OpPut(claimKey, h.Name))
			fixed = append(fixed, "subnet claim (wrong)")
		}
		for p := range own {
			if p != subnet {
				ops = append(ops, clientv3.OpDelete(store.ClaimKey(h.Name, p)))
				fixed = append(fixed, "claim on "+p.String()+" withdrawn")
			}
		}
		if len(ops) == 0 {
			return h, repaired, nil
		}
		// The claim stands as read, so it still holds (a later claim is
		// younger), and the record is as read.
		resp, err = s.Txn(ctx, []clientv3.Cmp{
			clientv3.Compare(clientv3.CreateRevision(claimKey), "=", own[subnet].CreateRevision),
			unchanged(hostKey, record),
		}, ops)
		if err != nil {
			return cluster.Host{}, nil, err
		}
		if resp.Succeeded {
			return h, append(repaired, fixed...), nil
		}
	}
	return cluster.Host{}, nil, fmt.Errorf("join %s: too much contention for subnets", h.Name)
}

// held returns the first of the subnets in the cluster that name holds.
// Failing that, any subnet it holds: a host whose record is gone (deleted
// by hand) finds its subnet again by its claim.
func held(c cluster.Config, holders map[netip.Prefix]store.Claim, name string, prefer ...netip.Prefix) (netip.Prefix, bool) {
	for _, p := range prefer {
		if p.IsValid() && holders[p].Host == name && valid(c, p) {
			return p, true
		}
	}
	for _, p := range Subnets(c) {
		if holders[p].Host == name {
			return p, true
		}
	}
	return netip.Prefix{}, false
}

func valid(c cluster.Config, p netip.Prefix) bool {
	return c.CIDR.Contains(p.Addr()) && p.Bits() == c.HostPrefix && p == p.Masked()
}

// claim writes name's claim on subnet unless it has one. Join withdraws
// it again if it loses (another's is older).
func claim(ctx context.Context, s *store.Store, name string, subnet netip.Prefix) error {
	key := store.ClaimKey(name, subnet)
	_, err := s.Txn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(key), "=", 0)},
		[]clientv3.Op{clientv3.OpPut(key, name)})
	return err
}

func freeSubnet(c cluster.Config, holders map[netip.Prefix]store.Claim, prefer netip.Prefix) (netip.Prefix, error) {
	if prefer.IsValid() && valid(c, prefer) && holders[prefer].Host == "" {
		return prefer, nil
	}
	for _, p := range Subnets(c) {
		if holders[p].Host == "" {
			return p, nil
		}
	}
	return netip.Prefix{}, fmt.Errorf("no free /%d in %s: %w", c.HostPrefix, c.CIDR, ErrExhausted)
}

// Allocate gives endpoint e an address from subnet and records the endpoint,
// in one transaction: the address e.IP holds when it is set (the runtime's
// choice: it must be one of the subnet's and free), else the next free one,
// round-robin from the last one given. Asking again for an endpoint that
// exists returns it unchanged.
func Allocate(ctx context.Context, s *store.Store, subnet netip.Prefix, e cluster.Endpoint) (cluster.Endpoint, error) {
	out, errs := AllocateAll(ctx, s, subnet, []cluster.Endpoint{e})
	return out[0], errs[0]
}

// chunk is how many endpoints one transaction allocates: etcd takes up to
// 128 operations in one (--max-txn-ops), and each takes two and two
// comparisons.
const chunk = 40

// AllocateAll is Allocate for endpoints of one host at once (the ADDs a
// burst of pods makes together): two round trips for every chunk of
// them, a read of the host's leases and of the endpoints' records, and a
// transaction that leases every new one's address and records it, which
// fails and is tried again when another writer got in between. Each
// endpoint's outcome is its own: one error does not fail the others.
func AllocateAll(ctx context.Context, s *store.Store, subnet netip.Prefix, es []cluster.Endpoint) ([]cluster.Endpoint, []error) {
	out, errs := make([]cluster.Endpoint, len(es)), make([]error, len(es))
	for i := 0; i < len(es); i += chunk {
		j := min(i+chunk, len(es))
		allocateChunk(ctx, s, subnet, es[i:j], out[i:j], errs[i:j])
	}
	return out, errs
}

func allocateChunk(ctx context.Context, s *store.Store, subnet netip.Prefix, es, out []cluster.Endpoint, errs []error) {
	first, last := cluster.Gateway(subnet).Next(), cluster.Broadcast(subnet).Prev()
	var pending []int
	seen := map[string]bool{}
	for i, e := range es {
		want := e.IP.Addr()
		switch {
		case e.Host != es[0].Host:
			errs[i] = fmt.Errorf("endpoint %s is not of host %s: one host's endpoints at a time", store.KeyOf(e), es[0].Host)
		case seen[store.KeyOf(e)]:
			errs[i] = fmt.Errorf("endpoint %s asked for twice at once", store.KeyOf(e))
		case e.IP.IsValid() && (want.Less(first) || last.Less(want)):
			errs[i] = fmt.Errorf("%s: %w %s (containers here get %s to %s)", want, ErrNotInSubnet, subnet, first, last)
		default:
			pending = append(pending, i)
		}
		seen[store.KeyOf(e)] = true
	}
	host := es[0].Host
	for attempt := 0; attempt < 16 && len(pending) > 0; attempt++ {
		reads := []clientv3.Op{clientv3.OpGet(store.AddrSubnetPrefix(host, subnet), clientv3.WithPrefix()), clientv3.OpGet(store.LastAddrKey(host, subnet))}
		for _, i := range pending {
			reads = append(reads, clientv3.OpGet(store.KeyOf(es[i])))
		}
		resp, err := s.Txn(ctx, nil, reads)
		if err != nil {
			for _, i := range pending {
				errs[i] = err
			}
			return
		}
		leases := map[string]string{} // address key → endpoint key
		for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
			leases[string(kv.Key)] = string(kv.Value)
		}
		var next netip.Addr
		if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) == 1 {
			next, _ = netip.ParseAddr(string(kvs[0].Value))
		}
		var cmps []clientv3.Cmp
		var ops []clientv3.Op
		var fresh []int
		roundRobin := false
		for k, i := range pending {
			e := es[i]
			epKey, want := store.KeyOf(e), e.IP.Addr()
			if kvs := resp.Responses[2+k].GetResponseRange().Kvs; len(kvs) == 1 {
				var existing cluster.Endpoint
				if err := json.Unmarshal(kvs[0].Value, &existing); err != nil {
					errs[i] = fmt.Errorf("endpoint %s: %w", epKey, err)
				} else if want.IsValid() && existing.IP.Addr() != want {
					errs[i] = fmt.Errorf("container %s has %s already, not %s: %w", e.ContainerID, existing.IP.Addr(), want, ErrInUse)
				} else {
					out[i] = existing
				}
				continue
			}
			addr := want
			if !want.IsValid() {
				if addr, err = nextFree(leases, host, subnet, next); err != nil {
					errs[i] = err
					continue
				}
				next, roundRobin = addr, true
			} else if by, taken := leases[store.AddrKey(host, subnet, want)]; taken {
				errs[i] = fmt.Errorf("%s: %w (by %s)", want, ErrInUse, by)
				continue
			}
			addrKey := store.AddrKey(host, subnet, addr)
			leases[addrKey] = epKey
			e.IP = netip.PrefixFrom(addr, subnet.Bits())
			val, _ := json.Marshal(e)
			cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(addrKey), "=", 0), clientv3.Compare(clientv3.CreateRevision(epKey), "=", 0))
			ops = append(ops, clientv3.OpPut(addrKey, epKey), clientv3.OpPut(epKey, string(val)))
			out[i] = e
			fresh = append(fresh, i)
		}
		if len(fresh) == 0 {
			return
		}
		if roundRobin {
			ops = append(ops, clientv3.OpPut(store.LastAddrKey(host, subnet), next.String()))
		}
		resp, err = s.Txn(ctx, cmps, ops)
		if err != nil {
			for _, i := range fresh {
				out[i], errs[i] = cluster.Endpoint{}, err
			}
			return
		}
		if resp.Succeeded {
			return
		}
		// another writer leased an address or recorded an endpoint in
		// between: read again
		for _, i := range fresh {
			out[i] = cluster.Endpoint{}
		}
		pending = fresh
	}
	for _, i := range pending {
		errs[i] = fmt.Errorf("allocate address for %s: too much contention", store.KeyOf(es[i]))
	}
}

// nextFree is the first address of subnet after last that leases does
// not hold, round the subnet.
func nextFree(leases map[string]string, host string, subnet netip.Prefix, last netip.Addr) (netip.Addr, error) {
	addrs := cluster.ContainerAddrs(subnet)
	start := 0
	for i, a := range addrs {
		if a == last {
			start = i + 1
			break
		}
	}
	for i := range addrs {
		a := addrs[(start+i)%len(addrs)]
		if _, used := leases[store.AddrKey(host, subnet, a)]; !used {
			return a, nil
		}
	}
	return netip.Addr{}, fmt.Errorf("subnet %s is full: %w", subnet, ErrExhausted)
}

// Release deletes endpoint e and frees its address. Releasing an endpoint
// that does not exist is not an error.
func Release(ctx context.Context, s *store.Store, e cluster.Endpoint) error {
	epKey := store.KeyOf(e)
	ops := []clientv3.Op{clientv3.OpDelete(epKey)}
	var err error
	if e.IP.IsValid() {
		addrKey := store.AddrKey(e.Host, e.IP.Masked(), e.IP.Addr())
		// Free the address only if it is still this endpoint's lease.
		_, err = s.Txn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.Value(addrKey), "=", epKey)},
			append(ops, clientv3.OpDelete(addrKey)), ops...)
	} else {
		_, err = s.Txn(ctx, nil, ops)
	}
	if err != nil {
		return err
	}
	// A limit set with skiff limit goes with its endpoint (a container
	// restarted under the same ID starts with its runtime's). A host
	// whose role predates limits may not delete it (skiff cert issue
	// grants it again): there it outlives the endpoint and holds again if
	// the same container ID and interface come back.
	_, err = s.Txn(ctx, nil, []clientv3.Op{clientv3.OpDelete(store.LimitKey(e.Host, e.ContainerID, e.IfName))})
	if errors.Is(err, store.ErrPermission) {
		return nil
	}
	return err
}
