package store

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
)

// What a host owns in the store. etcd grants permissions on key ranges
// only, so every key a host writes begins with its kind's prefix and the
// host's name, then "/" (or is exactly its host record): the range of h1
// never covers a key of h10.
//
//	hosts/H                   H's record
//	subnets/H/SUBNET          H's claim on SUBNET (value: H)
//	addrs/H/SUBNET/ADDR       H's lease of ADDR (value: the endpoint key)
//	addrs/H/last/SUBNET       the last address H handed out
//	endpoints/H/ID/IF         H's endpoints
//	listeners/H/ADDR:PORT     H's replaced listeners (sockets mode)
//	limits/H/ID/IF            rate limits set with skiff limit on H's
//	                          endpoints (the administrator writes them;
//	                          H deletes them with the endpoint)
//
// The cluster configuration and the policies are the administrator's.

// Range is a range of keys: Key alone, or [Key, End) when End is set.
type Range struct{ Key, End string }

func prefixRange(p string) Range { return Range{p, clientv3.GetPrefixRangeEnd(p)} }

// HostRanges are the keys host may write.
func HostRanges(host string) []Range {
	return []Range{
		{Key: HostKey(host)},
		prefixRange(SubnetsPrefix + host + "/"),
		prefixRange(AddrsPrefix + host + "/"),
		prefixRange(EndpointPrefix + host + "/"),
		prefixRange(ListenerPrefix + host + "/"),
		prefixRange(LimitPrefix + host + "/"),
	}
}

// ReadRange is what every host may read: the whole store of skiff.
var ReadRange = prefixRange(Prefix)

// OwnerOf returns the host a key belongs to, or "" for the
// administrator's keys (configuration, policies) and keys outside skiff's.
func OwnerOf(key string) string {
	if name, ok := strings.CutPrefix(key, HostsPrefix); ok {
		if strings.Contains(name, "/") {
			return ""
		}
		return name
	}
	for _, p := range []string{SubnetsPrefix, AddrsPrefix, EndpointPrefix, ListenerPrefix, LimitPrefix} {
		if rest, ok := strings.CutPrefix(key, p); ok {
			if host, _, ok := strings.Cut(rest, "/"); ok {
				return host
			}
		}
	}
	return ""
}

// ValidateHostName refuses names that cannot own keys of their own: empty,
// with a "/", or the certificate names of the administrator and of etcd's
// server.
func ValidateHostName(name string) error {
	switch {
	case name == "" || len(name) > 253:
		return fmt.Errorf("host name %q: want 1-253 characters", name)
	case strings.ContainsAny(name, "/ \t\n\x00"):
		return fmt.Errorf("host name %q: no slashes or white space", name)
	case name == AdminName || name == serverName:
		return fmt.Errorf("host name %q is reserved for the cluster store's own certificates", name)
	}
	return nil
}

// Claim is a host's claim on a subnet, with the revision that created it.
type Claim struct {
	Host   string
	Subnet netip.Prefix
	Rev    int64
}

// Holders resolves the claims: of the claims on one subnet the oldest (the
// lowest create revision; on a tie, which only one transaction writing
// both can make, the lower host name) holds the subnet. Every reader
// applies this rule, so a host that claims another's subnet later gains
// nothing: the earlier claim stands until its host is removed.
func Holders(claims []Claim) map[netip.Prefix]Claim {
	out := map[netip.Prefix]Claim{}
	for _, c := range claims {
		if h, ok := out[c.Subnet]; !ok || cmp.Or(cmp.Compare(c.Rev, h.Rev), strings.Compare(c.Host, h.Host)) < 0 {
			out[c.Subnet] = c
		}
	}
	return out
}

// ParseClaim reads a claim from its key and create revision; ok is false
// for keys that are not one.
func ParseClaim(kv *mvccpb.KeyValue) (Claim, bool) {
	rest, ok := strings.CutPrefix(string(kv.Key), SubnetsPrefix)
	if !ok {
		return Claim{}, false
	}
	host, name, ok := strings.Cut(rest, "/")
	if !ok || host == "" {
		return Claim{}, false
	}
	p, err := netip.ParsePrefix(strings.Replace(name, "-", "/", 1))
	if err != nil || p != p.Masked() {
		return Claim{}, false
	}
	return Claim{Host: host, Subnet: p, Rev: kv.CreateRevision}, true
}

// Claims returns every subnet claim, and the revision it was read at.
func (s *Store) Claims(ctx context.Context) ([]Claim, int64, error) {
	resp, err := s.get(ctx, SubnetsPrefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return nil, 0, err
	}
	return claimsOf(resp.Kvs), resp.Header.Revision, nil
}

func claimsOf(kvs []*mvccpb.KeyValue) []Claim {
	var out []Claim
	for _, kv := range kvs {
		if c, ok := ParseClaim(kv); ok {
			out = append(out, c)
		}
	}
	return out
}

// keyOf is where a record of the store belongs: a record found under
// another key (a host writing a record in another's name into its own
// keys) is not believed.
func keyOf(v any) string {
	switch v := v.(type) {
	case cluster.Host:
		return HostKey(v.Name)
	case cluster.Endpoint:
		return KeyOf(v)
	case cluster.Listener:
		return listenerKey(v)
	case policy.Rule:
		return PolicyPrefix + v.ID
	case cluster.LimitOverride:
		return LimitKey(v.Host, v.ContainerID, v.IfName)
	}
	return ""
}

// Owned keeps the endpoints and listeners whose address lies in the subnet
// their host holds: no host can publish another's addresses. hosts are as
// Hosts returns them.
func Owned[T cluster.Endpoint | cluster.Listener](hosts []cluster.Host, vs []T) []T {
	subnet := make(map[string]netip.Prefix, len(hosts))
	for _, h := range hosts {
		subnet[h.Name] = h.Subnet
	}
	out := vs[:0:0]
	for _, v := range vs {
		var host string
		var a netip.Addr
		switch v := any(v).(type) {
		case cluster.Endpoint:
			host, a = v.Host, v.IP.Addr()
		case cluster.Listener:
			host, a = v.Host, v.Addr.Addr()
		}
		if p, ok := subnet[host]; ok && p.Contains(a) {
			out = append(out, v)
		}
	}
	return out
}

// Underlays leaves out the hosts whose underlay address cannot be believed
// (cluster.UnderlayFault), and, of hosts publishing one address, all but the one
// whose subnet claim is oldest (the rule of Holders): a host cannot take
// another host's address, which every host accepts VXLAN from. Each record
// left out is logged with why.
func Underlays(hosts []cluster.Host, holders map[netip.Prefix]Claim, cidr netip.Prefix) []cluster.Host {
	first := map[netip.Addr]Claim{}
	for _, h := range hosts {
		c := holders[h.Subnet]
		if f, ok := first[h.UnderlayIP]; !ok || cmp.Or(cmp.Compare(c.Rev, f.Rev), strings.Compare(c.Host, f.Host)) < 0 {
			first[h.UnderlayIP] = c
		}
	}
	return slices.DeleteFunc(hosts, func(h cluster.Host) bool {
		if why := cluster.UnderlayFault(h.UnderlayIP, cidr); why != "" {
			slog.Warn("host record refused: its underlay address cannot be a host's", "host", h.Name, "underlay", h.UnderlayIP, "why", why)
			return true
		}
		if f := first[h.UnderlayIP]; f.Host != h.Name {
			slog.Warn("host record refused: another host publishes its underlay address", "host", h.Name, "underlay", h.UnderlayIP, "holder", f.Host)
			return true
		}
		return false
	})
}
