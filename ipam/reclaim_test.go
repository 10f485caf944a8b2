package ipam

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

// TestReclaim: a host's record and lease, deleted or garbled, come back
// with the same subnet; nothing is written when both are right; a subnet
// another host got meanwhile is ErrTaken, and nothing is written then.
func TestReclaim(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	h, err := Join(ctx, s, testCluster, cluster.Host{Name: "h2", UnderlayIP: netip.MustParseAddr("192.168.0.2")})
	if err != nil {
		t.Fatal(err)
	}
	revision := func() int64 {
		resp, err := s.Client.Get(ctx, store.Prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	put := func(key, val string) func() {
		return func() { s.Client.Put(ctx, key, val) }
	}
	del := func(keys ...string) func() {
		return func() {
			for _, k := range keys {
				s.Client.Delete(ctx, k)
			}
		}
	}
	hostKey, leaseKey := store.HostKey(h.Name), store.SubnetKey(h.Subnet)
	for _, tc := range []struct {
		name   string
		damage func()
		want   string // what Reclaim says it repaired
	}{
		{"intact", func() {}, ""},
		{"record deleted", del(hostKey), "host record (missing)"},
		{"lease deleted", del(leaseKey), "subnet lease (missing)"},
		{"both deleted", del(hostKey, leaseKey), "subnet lease (missing) host record (missing)"},
		{"garbage record", put(hostKey, `{"name": "h2", "subn`), "host record (wrong)"},
		{"record of another subnet", put(hostKey, `{"name":"h2","subnet":"10.244.9.0/24"}`), "host record (wrong)"},
		{"garbage lease", put(leaseKey, `{"x`), "subnet lease (wrong)"},
		{"lease naming a host without the subnet", put(leaseKey, "h9"), "subnet lease (wrong)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.damage()
			before := revision()
			repaired, err := Reclaim(ctx, s, testCluster, h)
			if err != nil || !strings.Contains(repaired, tc.want) {
				t.Fatalf("Reclaim = %q, %v; want it to repair %q", repaired, err, tc.want)
			}
			if got, want := revision()-before, int64(min(1, len(tc.want))); got != want {
				t.Errorf("%d writes, want %d", got, want)
			}
			stored, err := s.Host(ctx, h.Name)
			if err != nil || !stored.Equal(h) {
				t.Errorf("record %+v, %v; want %+v", stored, err, h)
			}
			if resp, _ := s.Client.Get(ctx, leaseKey); len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != h.Name {
				t.Errorf("lease %v, want %s", resp.Kvs, h.Name)
			}
			if again, err := Reclaim(ctx, s, testCluster, h); again != "" || err != nil {
				t.Errorf("second Reclaim = %q, %v; want nothing to repair", again, err)
			}
		})
	}

	// Record and lease gone, and another host joined with the subnet.
	del(hostKey, leaseKey)()
	h3, err := Join(ctx, s, testCluster, cluster.Host{Name: "h3", Subnet: h.Subnet})
	if err != nil || h3.Subnet != h.Subnet {
		t.Fatalf("h3 joined with %v, %v; want %v", h3.Subnet, err, h.Subnet)
	}
	before := revision()
	if _, err := Reclaim(ctx, s, testCluster, h); !errors.Is(err, ErrTaken) || !strings.Contains(err.Error(), "h3") {
		t.Fatalf("Reclaim of a subnet h3 holds: %v, want ErrTaken naming h3", err)
	}
	if revision() != before {
		t.Error("a failed Reclaim wrote to the store")
	}
	bad := h
	bad.Subnet = netip.MustParsePrefix("10.245.0.0/24")
	if _, err := Reclaim(ctx, s, testCluster, bad); err == nil || !strings.Contains(err.Error(), "not a /24 of 10.244.0.0/16") {
		t.Errorf("Reclaim of a subnet outside the cluster: %v", err)
	}
}
