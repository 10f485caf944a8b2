package store_test

import (
	"net/netip"
	"testing"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/store"
)

// TestHostRanges: every key of a host lies in one of its ranges, names it
// as its owner, and lies in none of another host's, not even one whose
// name begins with it (h1, h10).
func TestHostRanges(t *testing.T) {
	subnet := netip.MustParsePrefix("10.244.1.0/24")
	in := func(key string, rs []store.Range) bool {
		for _, r := range rs {
			if key == r.Key || r.End != "" && key >= r.Key && key < r.End {
				return true
			}
		}
		return false
	}
	keys := []string{
		store.HostKey("h1"),
		store.ClaimKey("h1", subnet),
		store.AddrKey("h1", subnet, netip.MustParseAddr("10.244.1.7")),
		store.LastAddrKey("h1", subnet),
		store.EndpointKey("h1", "c1", "eth0"),
		store.ListenerPrefix + "h1/10.244.1.7:80",
	}
	for _, k := range keys {
		if !in(k, store.HostRanges("h1")) {
			t.Errorf("%s: not in h1's ranges", k)
		}
		if o := store.OwnerOf(k); o != "h1" {
			t.Errorf("%s: owner %q, want h1", k, o)
		}
		for _, other := range []string{"h10", "h", "h1-", "h2"} {
			if in(k, store.HostRanges(other)) {
				t.Errorf("%s: in %s's ranges", k, other)
			}
		}
		if !in(k, []store.Range{store.ReadRange}) {
			t.Errorf("%s: not readable", k)
		}
	}
	for _, k := range []string{store.PolicyPrefix + "p1", store.Prefix + "config", store.HostsPrefix + "h1/x", "/other"} {
		if o := store.OwnerOf(k); o != "" {
			t.Errorf("%s: owner %q, want none (the administrator's)", k, o)
		}
		if in(k, store.HostRanges("h1")) {
			t.Errorf("%s: writable by h1", k)
		}
	}
}

// TestHolders: the oldest claim on a subnet holds it; a later one, or a
// tie broken by name, does not; claims on other subnets are their own.
func TestHolders(t *testing.T) {
	a, b := netip.MustParsePrefix("10.244.1.0/24"), netip.MustParsePrefix("10.244.2.0/24")
	got := store.Holders([]store.Claim{
		{Host: "h2", Subnet: a, Rev: 9},
		{Host: "h1", Subnet: a, Rev: 5},
		{Host: "h3", Subnet: a, Rev: 7},
		{Host: "h9", Subnet: b, Rev: 4},
		{Host: "h8", Subnet: b, Rev: 4},
	})
	if got[a].Host != "h1" || got[b].Host != "h8" || len(got) != 2 {
		t.Errorf("holders %v: want h1 for %s, h8 for %s", got, a, b)
	}
}

// TestOwned: endpoints and listeners count only in the subnet their host
// holds.
func TestOwned(t *testing.T) {
	hosts := []cluster.Host{{Name: "h1", Subnet: netip.MustParsePrefix("10.244.1.0/24")}, {Name: "h2", Subnet: netip.MustParsePrefix("10.244.2.0/24")}}
	eps := []cluster.Endpoint{
		{Host: "h1", ContainerID: "ok", IP: netip.MustParsePrefix("10.244.1.5/24")},
		{Host: "h1", ContainerID: "h2s", IP: netip.MustParsePrefix("10.244.2.5/24")},
		{Host: "h3", ContainerID: "nohost", IP: netip.MustParsePrefix("10.244.1.6/24")},
	}
	if got := store.Owned(hosts, eps); len(got) != 1 || got[0].ContainerID != "ok" {
		t.Errorf("endpoints %v: want only ok", got)
	}
	ls := []cluster.Listener{{Host: "h2", Addr: netip.MustParseAddrPort("10.244.2.5:80")}, {Host: "h1", Addr: netip.MustParseAddrPort("10.244.2.6:80")}}
	if got := store.Owned(hosts, ls); len(got) != 1 || got[0].Host != "h2" {
		t.Errorf("listeners %v: want only h2's", got)
	}
}

func TestValidateHostName(t *testing.T) {
	for _, n := range []string{"", "a/b", "root", "server", "a b"} {
		if store.ValidateHostName(n) == nil {
			t.Errorf("host name %q accepted", n)
		}
	}
	for _, n := range []string{"h1", "node-2.example"} {
		if err := store.ValidateHostName(n); err != nil {
			t.Errorf("host name %q: %v", n, err)
		}
	}
}
