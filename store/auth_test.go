package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/ipam"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

// asHost opens the store with a host's own certificate, after the
// administrator made its user and role.
func asHost(t *testing.T, admin *store.Store, e *store.Embedded, name string) *store.Store {
	t.Helper()
	if err := admin.AllowHost(context.Background(), name); err != nil {
		t.Fatal(err)
	}
	creds, err := e.ClientTLS(name)
	if err != nil {
		t.Fatal(err)
	}
	s, err := store.Open([]string{e.URL}, creds)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestHostPrivileges: with the store's authentication on (the embedded
// store turns it on), a host joins, leases addresses and publishes its
// endpoints with its own certificate; it reads another host's keys but
// cannot write or delete them (not even those of a host whose name begins
// with its own), nor write policies; the administrator can.
func TestHostPrivileges(t *testing.T) {
	admin, e := storetest.New(t)
	ctx := context.Background()
	h1, h10 := asHost(t, admin, e, "h1"), asHost(t, admin, e, "h10")
	if _, err := h1.EnsureCluster(ctx, testCluster); err != nil {
		t.Fatal(err)
	}
	host10, err := ipam.Join(ctx, h10, testCluster, cluster.Host{Name: "h10", UnderlayIP: netip.MustParseAddr("192.0.2.10")})
	if err != nil {
		t.Fatal(err)
	}
	ep, err := ipam.Allocate(ctx, h10, host10.Subnet, cluster.Endpoint{Host: "h10", ContainerID: "c1", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	host1, err := ipam.Join(ctx, h1, testCluster, cluster.Host{Name: "h1", UnderlayIP: netip.MustParseAddr("192.0.2.1")})
	if err != nil {
		t.Fatal(err)
	}
	if host1.Subnet == host10.Subnet {
		t.Fatalf("h1 and h10 both hold %s", host1.Subnet)
	}
	// Reading works.
	if hosts, err := h1.Hosts(ctx); err != nil || len(hosts) != 2 {
		t.Fatalf("h1 reads hosts: %v, %v", hosts, err)
	}
	if eps, err := h1.Endpoints(ctx, "h10"); err != nil || len(eps) != 1 {
		t.Fatalf("h1 reads h10's endpoints: %v, %v", eps, err)
	}
	// Writing another's keys does not.
	val, _ := json.Marshal(host10)
	rule := policy.Rule{ID: "p", Priority: 1, Action: policy.Deny}
	for what, err := range map[string]error{
		"put h10's record":     put(h1, store.HostKey("h10"), string(val)),
		"delete h10's record":  del(h1, store.HostKey("h10")),
		"put h10's endpoint":   put(h1, store.KeyOf(ep), "{}"),
		"delete h10's":         del(h1, store.EndpointPrefix+"h10/", clientv3.WithPrefix()),
		"claim in h10's name":  put(h1, store.ClaimKey("h10", netip.MustParsePrefix("10.244.200.0/24")), "h10"),
		"delete h10's claim":   del(h1, store.ClaimKey("h10", host10.Subnet)),
		"delete h10's leases":  del(h1, store.AddrsPrefix+"h10/", clientv3.WithPrefix()),
		"put h10's listener":   put(h1, store.ListenerPrefix+"h10/10.244.0.2:80", "{}"),
		"delete every host":    del(h1, store.HostsPrefix, clientv3.WithPrefix()),
		"put a policy":         h1.PutPolicy(ctx, rule),
		"remove h10":           h1.RemoveHost(ctx, "h10"),
		"make a user":          h1.AllowHost(ctx, "h2"),
		"write outside skiff":  put(h1, "/other", "x"),
		"h10 puts h1's record": put(h10, store.HostKey("h1"), "{}"),
	} {
		if !errors.Is(err, store.ErrPermission) {
			t.Errorf("%s: %v, want ErrPermission", what, err)
		}
	}
	// The administrator can.
	if err := admin.PutPolicy(ctx, rule); err != nil {
		t.Fatal(err)
	}
	if err := admin.RemoveHost(ctx, "h10"); err != nil {
		t.Fatal(err)
	}
	if err := admin.RevokeHost(ctx, "h10"); err != nil {
		t.Fatal(err)
	}
	if err := h10.Ping(ctx); !errors.Is(err, store.ErrPermission) {
		t.Errorf("a revoked host reads: %v", err)
	}
}

// TestClaimRule: a host that claims a subnet another host holds, and
// writes a record naming it, is left out of the hosts every reader lists;
// the holder keeps its subnet, and a new host gets another.
func TestClaimRule(t *testing.T) {
	admin, e := storetest.New(t)
	ctx := context.Background()
	h1, h2 := asHost(t, admin, e, "h1"), asHost(t, admin, e, "h2")
	host1, err := ipam.Join(ctx, h1, testCluster, cluster.Host{Name: "h1", UnderlayIP: netip.MustParseAddr("192.0.2.1")})
	if err != nil {
		t.Fatal(err)
	}
	// h2 forges a claim on h1's subnet and a record naming it.
	if err := put(h2, store.ClaimKey("h2", host1.Subnet), "h2"); err != nil {
		t.Fatal(err)
	}
	forged, _ := json.Marshal(cluster.Host{Name: "h2", Subnet: host1.Subnet})
	if err := put(h2, store.HostKey("h2"), string(forged)); err != nil {
		t.Fatal(err)
	}
	// And an endpoint in h1's name in its own keys.
	fake, _ := json.Marshal(cluster.Endpoint{Host: "h1", ContainerID: "x", IfName: "eth0", IP: netip.PrefixFrom(host1.Subnet.Addr().Next().Next(), 24)})
	if err := put(h2, store.EndpointKey("h2", "x", "eth0"), string(fake)); err != nil {
		t.Fatal(err)
	}
	if eps, err := h1.Endpoints(ctx, ""); err != nil || len(eps) != 0 {
		t.Fatalf("endpoints %v, %v: want none", eps, err)
	}
	if hosts, err := admin.Hosts(ctx); err != nil || len(hosts) != 1 || hosts[0].Name != "h1" {
		t.Fatalf("hosts %v, %v: want h1 alone", hosts, err)
	}
	host3, err := ipam.Join(ctx, admin, testCluster, cluster.Host{Name: "h3", UnderlayIP: netip.MustParseAddr("192.0.2.3")})
	if err != nil || host3.Subnet == host1.Subnet {
		t.Fatalf("h3 joined with %v, %v", host3, err)
	}
	// h2 joining properly gives up the claim it lost and takes a free subnet.
	host2, err := ipam.Join(ctx, h2, testCluster, cluster.Host{Name: "h2", Subnet: host1.Subnet})
	if err != nil || host2.Subnet == host1.Subnet || host2.Subnet == host3.Subnet {
		t.Fatalf("h2 joined with %v, %v", host2, err)
	}
	claims, _, err := admin.Claims(ctx)
	if err != nil || len(claims) != 3 {
		t.Fatalf("claims %v, %v: want one per host", claims, err)
	}
	// A host whose record is gone finds its subnet again by its claim.
	if err := del(h1, store.HostKey("h1")); err != nil {
		t.Fatal(err)
	}
	if again, err := ipam.Join(ctx, h1, testCluster, cluster.Host{Name: "h1", UnderlayIP: netip.MustParseAddr("192.0.2.1")}); err != nil || again.Subnet != host1.Subnet {
		t.Fatalf("h1 rejoined with %v, %v; want %s", again, err, host1.Subnet)
	}
}

func put(s *store.Store, key, val string) error {
	_, err := s.Txn(context.Background(), nil, []clientv3.Op{clientv3.OpPut(key, val)})
	return err
}

func del(s *store.Store, key string, opts ...clientv3.OpOption) error {
	_, err := s.Txn(context.Background(), nil, []clientv3.Op{clientv3.OpDelete(key, opts...)})
	return err
}
