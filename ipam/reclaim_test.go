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

// TestReclaim: a host's record and claim, deleted or garbled by the
// administrator, come back with the same subnet, written with the host's
// own certificate; nothing is written when both are right. A younger claim
// of another host on the subnet changes nothing; once it is the oldest
// (the host's own claim deleted), the subnet is ErrTaken, and nothing is
// written then; when that host is removed the subnet is reclaimed.
func TestReclaim(t *testing.T) {
	admin, e := storetest.New(t)
	ctx := context.Background()
	if err := admin.AllowHost(ctx, "h2"); err != nil {
		t.Fatal(err)
	}
	creds, err := e.ClientTLS("h2")
	if err != nil {
		t.Fatal(err)
	}
	s, err := store.Open([]string{e.URL}, creds)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	h, err := Join(ctx, s, testCluster, cluster.Host{Name: "h2", UnderlayIP: netip.MustParseAddr("192.168.0.2")})
	if err != nil {
		t.Fatal(err)
	}
	revision := func() int64 {
		resp, err := admin.Client.Get(ctx, store.Prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	do := func(ops ...clientv3.Op) func() {
		return func() {
			if _, err := admin.Client.Txn(ctx).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
		}
	}
	other := netip.MustParsePrefix("10.244.9.0/24")
	hostKey, claimKey := store.HostKey(h.Name), store.ClaimKey(h.Name, h.Subnet)
	del, put := clientv3.OpDelete, func(k, v string) clientv3.Op { return clientv3.OpPut(k, v) }
	for _, tc := range []struct {
		name   string
		damage func()
		want   string // what Reclaim says it repaired
		writes int64
	}{
		{"intact", func() {}, "", 0},
		{"record deleted", do(del(hostKey)), "host record (missing)", 1},
		{"claim deleted", do(del(claimKey)), "subnet claim (missing)", 1},
		{"both deleted", do(del(hostKey), del(claimKey)), "subnet claim (missing), host record (missing)", 2},
		{"garbage record", do(put(hostKey, `{"name": "h2", "subn`)), "host record (wrong)", 1},
		{"record of another subnet", do(put(hostKey, `{"name":"h2","subnet":"10.244.9.0/24"}`)), "host record (wrong)", 1},
		{"garbage claim", do(put(claimKey, `{"x`)), "subnet claim (wrong)", 1},
		{"record of another subnet the host claims too", do(put(hostKey, `{"name":"h2","subnet":"10.244.9.0/24"}`),
			put(store.ClaimKey(h.Name, other), h.Name)), "host record (wrong), claim on 10.244.9.0/24 withdrawn", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.damage()
			before := revision()
			repaired, err := Reclaim(ctx, s, testCluster, h)
			if err != nil || repaired != tc.want {
				t.Fatalf("Reclaim = %q, %v; want it to repair %q", repaired, err, tc.want)
			}
			if got := revision() - before; got != tc.writes {
				t.Errorf("%d writes, want %d", got, tc.writes)
			}
			stored, err := s.Host(ctx, h.Name)
			if err != nil || !stored.Equal(h) {
				t.Errorf("record %+v, %v; want %+v", stored, err, h)
			}
			claims, _, err := s.Claims(ctx)
			if err != nil || len(claims) != 1 || store.Holders(claims)[h.Subnet].Host != h.Name {
				t.Errorf("claims %v, %v; want %s's alone", claims, err, h.Name)
			}
			if resp, _ := s.Client.Get(ctx, claimKey); len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != h.Name {
				t.Errorf("claim %v, want %s", resp.Kvs, h.Name)
			}
			if again, err := Reclaim(ctx, s, testCluster, h); again != "" || err != nil {
				t.Errorf("second Reclaim = %q, %v; want nothing to repair", again, err)
			}
		})
	}

	// h3 claims h2's subnet: a younger claim, it changes nothing.
	do(put(store.ClaimKey("h3", h.Subnet), "h3"))()
	before := revision()
	if repaired, err := Reclaim(ctx, s, testCluster, h); repaired != "" || err != nil {
		t.Fatalf("Reclaim with h3's younger claim = %q, %v; want nothing to repair", repaired, err)
	}
	if revision() != before {
		t.Error("Reclaim wrote with nothing to repair")
	}
	// h2's claim deleted: h3's is now the oldest.
	do(del(hostKey), del(claimKey))()
	before = revision()
	for range 2 {
		if _, err := Reclaim(ctx, s, testCluster, h); !errors.Is(err, ErrTaken) || !strings.Contains(err.Error(), "h3") {
			t.Fatalf("Reclaim of a subnet h3 holds: %v, want ErrTaken naming h3", err)
		}
	}
	if revision() != before {
		t.Error("a failed Reclaim wrote to the store")
	}
	// h3 removed: h2 claims the subnet again.
	do(del(store.ClaimKey("h3", h.Subnet)))()
	if repaired, err := Reclaim(ctx, s, testCluster, h); err != nil || repaired != "subnet claim (missing), host record (missing)" {
		t.Fatalf("Reclaim after h3 left = %q, %v", repaired, err)
	}
	bad := h
	bad.Subnet = netip.MustParsePrefix("10.245.0.0/24")
	if _, err := Reclaim(ctx, s, testCluster, bad); err == nil || !strings.Contains(err.Error(), "not a /24 of 10.244.0.0/16") {
		t.Errorf("Reclaim of a subnet outside the cluster: %v", err)
	}
}
