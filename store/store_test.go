package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/ipam"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

var testCluster = cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: 1, VXLANPort: 4789}

func TestEnsureCluster(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	if _, err := s.EnsureCluster(ctx, testCluster); err != nil {
		t.Fatal(err)
	}
	if _, err := s.EnsureCluster(ctx, testCluster); err != nil {
		t.Fatalf("same config again: %v", err)
	}
	other := testCluster
	other.VNI = 7
	if _, err := s.EnsureCluster(ctx, other); err == nil {
		t.Fatal("a conflicting testCluster config was accepted")
	}
	bad := testCluster
	bad.CIDR = netip.MustParsePrefix("10.244.1.0/16")
	if _, err := s.EnsureCluster(ctx, bad); err == nil {
		t.Fatal("a CIDR with host bits was accepted")
	}
}

func TestRemoveHostTakesItsState(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	h, err := ipam.Join(ctx, s, testCluster, cluster.Host{Name: "h1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ipam.Allocate(ctx, s, h.Subnet, cluster.Endpoint{Host: "h1", ContainerID: "c", IfName: "eth0"}); err != nil {
		t.Fatal(err)
	}
	if err := s.RemoveHost(ctx, "h1"); err != nil {
		t.Fatal(err)
	}
	resp, err := s.Client.Get(ctx, store.Prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		if k := string(kv.Key); k != store.Prefix+"config" {
			t.Errorf("left behind: %s", k)
		}
	}
	if err := s.RemoveHost(ctx, "h1"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("removing a removed host: %v", err)
	}
}

func TestPoliciesAndWatch(t *testing.T) {
	s, _ := storetest.New(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changed := s.Watch(ctx, store.PolicyPrefix)
	r := policy.Rule{ID: "b", Priority: 2, Action: policy.Deny, Proto: policy.TCP, Port: 80}
	if err := s.PutPolicy(ctx, r); err != nil {
		t.Fatal(err)
	}
	if err := s.PutPolicy(ctx, policy.Rule{ID: "a", Priority: 5, Action: policy.Allow}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	case <-time.After(2 * time.Second):
		t.Fatal("no watch signal within 2s")
	}
	set, err := s.Policies(ctx)
	if err != nil || len(set) != 2 || set[0] != r {
		t.Fatalf("policies = %v, %v", set, err)
	}
	if err := s.PutPolicy(ctx, policy.Rule{ID: "Bad"}); err == nil {
		t.Fatal("invalid rule stored")
	}
	if err := s.DeletePolicy(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if err := s.DeletePolicy(ctx, "b"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
}

func TestUnreachableIsUnavailable(t *testing.T) {
	s, e := storetest.New(t)
	e.Close()
	start := time.Now()
	_, err := s.Hosts(context.Background())
	if !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("err = %v, want ErrUnavailable", err)
	}
	if time.Since(start) > 10*time.Second {
		t.Fatalf("took %v to notice", time.Since(start))
	}
}

func TestListeners(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	l := func(host, addr string) cluster.Listener {
		return cluster.Listener{Host: host, Addr: netip.MustParseAddrPort(addr)}
	}
	a, b, c := l("h1", "10.244.1.2:80"), l("h1", "10.244.1.3:8080"), l("h2", "10.244.2.2:80")
	if err := s.SetListeners(ctx, "h1", []cluster.Listener{a, b}); err != nil {
		t.Fatal(err)
	}
	if err := s.SetListeners(ctx, "h2", []cluster.Listener{c}); err != nil {
		t.Fatal(err)
	}
	// An unchanged set writes nothing (no watcher wakes up).
	rev := func() int64 {
		resp, err := s.Client.Get(ctx, "/")
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	before := rev()
	if err := s.SetListeners(ctx, "h1", []cluster.Listener{b, a}); err != nil {
		t.Fatal(err)
	}
	if rev() != before {
		t.Error("setting the same listeners wrote to the store")
	}
	if err := s.SetListeners(ctx, "h1", []cluster.Listener{b}); err != nil {
		t.Fatal(err)
	}
	got, err := s.Listeners(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != b || got[1] != c {
		t.Fatalf("listeners %v, want [%v %v]", got, b, c)
	}
	if err := s.SetListeners(ctx, "h1", []cluster.Listener{c}); err == nil {
		t.Error("h1 published h2's listener")
	}
	// A request etcd refuses is not an unreachable store.
	var ops []clientv3.Op
	for i := range 129 { // etcd takes 128
		ops = append(ops, clientv3.OpPut(fmt.Sprintf("/skiff-test/%d", i), "x"))
	}
	if _, err := s.Txn(ctx, nil, ops); err == nil || errors.Is(err, store.ErrUnavailable) || !strings.Contains(err.Error(), "too many operations") {
		t.Errorf("a transaction of %d operations: %v", len(ops), err)
	}
	// More listeners than etcd takes in one transaction, then as many
	// others in their place (twice the changes), then none.
	many := func(port uint16) []cluster.Listener {
		var ls []cluster.Listener
		for i := range 300 {
			ls = append(ls, cluster.Listener{Host: "h1", Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, 1, byte(i%250 + 2)}), port+uint16(i/250))})
		}
		return ls
	}
	for _, want := range [][]cluster.Listener{many(9000), many(7000), nil} {
		if err := s.SetListeners(ctx, "h1", want); err != nil {
			t.Fatalf("%d listeners: %v", len(want), err)
		}
		got, err := s.Listeners(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n := len(got) - 1; n != len(want) { // and h2's
			t.Fatalf("%d listeners stored, want %d", n, len(want))
		}
	}
}

// TestWatchListeners: the cache starts from the store's listeners, follows
// each change (with a signal), and its channel closes with the context.
func TestWatchListeners(t *testing.T) {
	s, _ := storetest.New(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l := func(host, addr string) cluster.Listener {
		return cluster.Listener{Host: host, Addr: netip.MustParseAddrPort(addr)}
	}
	a, b, c := l("h1", "10.244.1.2:80"), l("h1", "10.244.1.10:80"), l("h2", "10.244.2.2:80")
	if err := s.SetListeners(ctx, "h1", []cluster.Listener{a}); err != nil {
		t.Fatal(err)
	}
	cache, changed, err := s.WatchListeners(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := cache.List(); !slices.Equal(got, []cluster.Listener{a}) {
		t.Fatalf("first read: %v", got)
	}
	for _, step := range []struct {
		host string
		set  []cluster.Listener
		want []cluster.Listener
	}{
		{"h1", []cluster.Listener{a, b}, []cluster.Listener{a, b}},
		{"h2", []cluster.Listener{c}, []cluster.Listener{a, b, c}},
		{"h1", []cluster.Listener{b}, []cluster.Listener{b, c}},
	} {
		if err := s.SetListeners(ctx, step.host, step.set); err != nil {
			t.Fatal(err)
		}
		awaitList(t, cache, changed, step.want)
	}
	cancel()
	for range changed { // drains, and ends when the watch does
	}
}

// awaitList waits until a watch's cache lists want, failing after 5 s.
func awaitList[T comparable](t *testing.T, cache *store.Cache[T], changed <-chan struct{}, want []T) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for got := cache.List(); !slices.Equal(got, want); got = cache.List() {
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("the cache lists %v, want %v", got, want)
		}
	}
}

// BenchmarkListeners compares what an agent did per listener change, a
// read of every listener of the cluster (2 000 on 20 hosts), with what it
// does now, a copy of the watch's cache.
func BenchmarkListeners(b *testing.B) {
	s, _ := storetest.New(b)
	ctx := context.Background()
	for h := range 20 {
		host := fmt.Sprintf("h%d", h)
		var ls []cluster.Listener
		for i := range 100 {
			ls = append(ls, cluster.Listener{Host: host, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(h), byte(i + 2)}), 8080)})
		}
		if err := s.SetListeners(ctx, host, ls); err != nil {
			b.Fatal(err)
		}
	}
	readOrCache(b, 2000, func() ([]cluster.Listener, error) { return s.Listeners(ctx) }, s.WatchListeners)
}

// readOrCache runs the two ways to get n values: read from the store each
// time, or copied from a watch's cache.
func readOrCache[T any](b *testing.B, n int, read func() ([]T, error),
	watch func(context.Context) (*store.Cache[T], <-chan struct{}, error)) {
	b.Run("read", func(b *testing.B) {
		for b.Loop() {
			if vs, err := read(); err != nil || len(vs) != n {
				b.Fatal(len(vs), err)
			}
		}
	})
	b.Run("cache", func(b *testing.B) {
		cache, _, err := watch(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if vs := cache.List(); len(vs) != n {
				b.Fatal(len(vs))
			}
		}
	})
}

// putEndpoint writes e as IPAM would.
func putEndpoint(t testing.TB, s *store.Store, e cluster.Endpoint) {
	t.Helper()
	val, _ := json.Marshal(e)
	if _, err := s.Client.Put(context.Background(), store.KeyOf(e), string(val)); err != nil {
		t.Fatal(err)
	}
}

func TestWatchEndpoints(t *testing.T) {
	s, _ := storetest.New(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ep := func(host, id, ip string) cluster.Endpoint {
		return cluster.Endpoint{Host: host, ContainerID: id, IfName: "eth0", IP: netip.MustParsePrefix(ip)}
	}
	a, b, c := ep("h1", "c1", "10.244.1.2/24"), ep("h1", "c2", "10.244.1.3/24"), ep("h2", "c1", "10.244.2.2/24")
	withMAC := c
	withMAC.MAC = "02:00:00:00:00:01"
	putEndpoint(t, s, b)
	cache, changed, err := s.WatchEndpoints(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := cache.List(); !slices.Equal(got, []cluster.Endpoint{b}) {
		t.Fatalf("first read: %v", got)
	}
	for _, step := range []struct {
		change func()
		want   []cluster.Endpoint
	}{
		{func() { putEndpoint(t, s, c) }, []cluster.Endpoint{b, c}},
		{func() { putEndpoint(t, s, a) }, []cluster.Endpoint{a, b, c}},
		{func() { s.Client.Delete(ctx, store.KeyOf(b)) }, []cluster.Endpoint{a, c}},
		{func() { putEndpoint(t, s, withMAC) }, []cluster.Endpoint{a, withMAC}},
	} {
		step.change()
		awaitList(t, cache, changed, step.want)
		// The cache lists what a read of the store lists, in its order.
		if all, err := s.Endpoints(ctx, ""); err != nil || !slices.Equal(all, cache.List()) {
			t.Fatalf("the store lists %v (%v), the cache %v", all, err, cache.List())
		}
	}
	// A value at a host's key that does not decode is not believed: a host
	// writes what it likes into its own keys, and must not stop every
	// agent's watch. It leaves the cache, and the watch goes on.
	s.Client.Put(ctx, store.KeyOf(a), "{")
	awaitList(t, cache, changed, []cluster.Endpoint{withMAC})
	if all, err := s.Endpoints(ctx, ""); err != nil || !slices.Equal(all, cache.List()) {
		t.Fatalf("after a garbled record the store lists %v (%v), the cache %v", all, err, cache.List())
	}
	putEndpoint(t, s, a)
	awaitList(t, cache, changed, []cluster.Endpoint{a, withMAC})
	// A policy that does not decode is an error: half a policy is not
	// applied.
	s.Client.Put(ctx, store.PolicyPrefix+"broken", "{")
	if _, err := s.Policies(ctx); err == nil {
		t.Error("a policy that does not decode was read without an error")
	}
}

// BenchmarkEndpoints compares what an agent in cache mode did per
// endpoint change, a read of every endpoint of the cluster (10 000 on 100
// hosts), with what it does now, a copy of the watch's cache.
func BenchmarkEndpoints(b *testing.B) {
	s, _ := storetest.New(b)
	ctx := context.Background()
	for h := range 100 {
		for i := range 100 {
			putEndpoint(b, s, cluster.Endpoint{Host: fmt.Sprintf("h%d", h), ContainerID: fmt.Sprintf("%064x", h*1000+i),
				IfName: "eth0", Netns: fmt.Sprintf("/var/run/netns/cni-%d-%d", h, i),
				IP: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 244, byte(h), byte(i + 2)}), 24), MAC: "02:42:0a:f4:00:02"})
		}
	}
	readOrCache(b, 10000, func() ([]cluster.Endpoint, error) { return s.Endpoints(ctx, "") }, s.WatchEndpoints)
}

// TestHostsRefuseUnderlays: a record whose underlay address is another
// host's (the older claim keeps it), loopback, multicast, unspecified,
// link-local or inside the cluster's range is left out of Hosts, which
// every agent routes and accepts VXLAN by.
func TestHostsRefuseUnderlays(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	if _, err := s.EnsureCluster(ctx, testCluster); err != nil {
		t.Fatal(err)
	}
	join := func(name, underlay string) cluster.Host {
		t.Helper()
		h, err := ipam.Join(ctx, s, testCluster, cluster.Host{Name: name, UnderlayIP: netip.MustParseAddr(underlay)})
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	join("h1", "10.99.0.1")
	h2 := join("h2", "10.99.0.2")
	for name, addr := range map[string]string{"taker": "10.99.0.1", "lo": "127.0.0.1", "mc": "224.0.0.1", "any": "0.0.0.0",
		"ll": "169.254.1.1", "bcast": "255.255.255.255", "inside": "10.244.200.1"} {
		join(name, addr)
	}
	names := func() []string {
		hosts, err := s.Hosts(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, h := range hosts {
			out = append(out, h.Name)
		}
		slices.Sort(out)
		return out
	}
	if got := names(); !slices.Equal(got, []string{"h1", "h2"}) {
		t.Errorf("hosts %v, want [h1 h2]", got)
	}
	// h2 rewrites its own record with h1's address: h2 goes, h1 stays.
	h2.UnderlayIP = netip.MustParseAddr("10.99.0.1")
	val, _ := json.Marshal(h2)
	if _, err := s.Client.Put(ctx, store.HostKey("h2"), string(val)); err != nil {
		t.Fatal(err)
	}
	if got := names(); !slices.Equal(got, []string{"h1"}) {
		t.Errorf("hosts %v after h2 took h1's underlay address, want [h1]", got)
	}
	if why := cluster.UnderlayFault(netip.MustParseAddr("10.99.0.3"), testCluster.CIDR); why != "" {
		t.Errorf("a plain underlay address refused: %s", why)
	}
}
