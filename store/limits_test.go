package store_test

import (
	"context"
	"errors"
	"testing"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/ipam"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

// TestLimits: a limit set on an endpoint takes the place of its runtime's,
// is refused for an endpoint that does not exist or a limit that does not
// validate, goes with its endpoint, and belongs to the endpoint's host.
func TestLimits(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	h, err := ipam.Join(ctx, s, testCluster, cluster.Host{Name: "h1"})
	if err != nil {
		t.Fatal(err)
	}
	cni := cluster.Limit{EgressRate: 5e7, EgressBurst: 1e6}
	e, err := ipam.Allocate(ctx, s, h.Subnet, cluster.Endpoint{Host: "h1", ContainerID: "c", IfName: "eth0", Limit: cni})
	if err != nil {
		t.Fatal(err)
	}
	set := cluster.Limit{IngressRate: 1e8, IngressBurst: 2e6}
	o := cluster.LimitOverride{Host: "h1", ContainerID: "c", IfName: "eth0", Limit: set}
	if err := s.PutLimit(ctx, o); err != nil {
		t.Fatal(err)
	}
	ghost := o
	ghost.ContainerID = "gone"
	if err := s.PutLimit(ctx, ghost); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("limit on a missing endpoint: %v", err)
	}
	bad := o
	bad.Limit.IngressBurst = 0
	if err := s.PutLimit(ctx, bad); err == nil {
		t.Error("a rate without a burst was stored")
	}
	got, err := s.Limits(ctx, "h1")
	if err != nil || len(got) != 1 || got[store.KeyOf(e)].Limit != set {
		t.Fatalf("Limits = %+v, %v", got, err)
	}
	if eps := store.WithLimits([]cluster.Endpoint{e}, got); eps[0].Limit != set.Clamp() {
		t.Errorf("in force: %+v, want %+v", eps[0].Limit, set.Clamp())
	}
	if owner := store.OwnerOf(store.LimitKey("h1", "c", "eth0")); owner != "h1" {
		t.Errorf("owner %q", owner)
	}
	if err := ipam.Release(ctx, s, e); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Limits(ctx, ""); err != nil || len(got) != 0 {
		t.Errorf("limit outlived its endpoint: %+v, %v", got, err)
	}
	if err := s.DeleteLimit(ctx, "h1", "c", "eth0"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("delete a missing limit: %v", err)
	}
}
