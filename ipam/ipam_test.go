package ipam

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

var testCluster = cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: 1, VXLANPort: 4789}

func TestSubnets(t *testing.T) {
	got := Subnets(testCluster)
	if len(got) != 256 || got[0].String() != "10.244.0.0/24" || got[255].String() != "10.244.255.0/24" {
		t.Fatalf("subnets: %d, first %v, last %v", len(got), got[0], got[len(got)-1])
	}
	addrs := cluster.ContainerAddrs(netip.MustParsePrefix("10.244.3.0/24"))
	if len(addrs) != 253 || addrs[0].String() != "10.244.3.2" || addrs[252].String() != "10.244.3.254" {
		t.Fatalf("host addrs: %d, %v..%v", len(addrs), addrs[0], addrs[len(addrs)-1])
	}
	if cluster.Gateway(got[3]).String() != "10.244.3.1" || cluster.VTEPAddr(got[3]).String() != "10.244.3.0" {
		t.Fatal("gateway or VTEP address wrong")
	}
}

func TestConcurrentJoinsGetDistinctSubnets(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	const agents = 8
	var wg sync.WaitGroup
	hosts := make([]cluster.Host, agents)
	errs := make([]error, agents)
	for i := range agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each agent has its own client, as separate processes would.
			own, err := store.Open(s.Client.Endpoints(), s.TLS())
			if err != nil {
				errs[i] = err
				return
			}
			defer own.Close()
			hosts[i], errs[i] = Join(ctx, own, testCluster, cluster.Host{Name: fmt.Sprintf("h%d", i),
				UnderlayIP: netip.AddrFrom4([4]byte{192, 168, 0, byte(i + 1)})})
		}()
	}
	wg.Wait()
	seen := map[netip.Prefix]string{}
	for i, h := range hosts {
		if errs[i] != nil {
			t.Fatalf("agent %d: %v", i, errs[i])
		}
		if other, dup := seen[h.Subnet]; dup {
			t.Fatalf("%s and %s both got %s", other, h.Name, h.Subnet)
		}
		seen[h.Subnet] = h.Name
	}
	// Joining again keeps the subnet and updates the record.
	again, err := Join(ctx, s, testCluster, cluster.Host{Name: "h3", UnderlayIP: netip.MustParseAddr("192.168.0.99")})
	if err != nil || again.Subnet != hosts[3].Subnet {
		t.Fatalf("rejoin: %v %v, want subnet %v", again, err, hosts[3].Subnet)
	}
	if stored, _ := s.Host(ctx, "h3"); stored.UnderlayIP != again.UnderlayIP {
		t.Fatalf("rejoin did not update the underlay address: %+v", stored)
	}
}

func TestSubnetExhaustion(t *testing.T) {
	s, _ := storetest.New(t)
	small := cluster.Config{CIDR: netip.MustParsePrefix("10.9.0.0/23"), HostPrefix: 24, VNI: 1, VXLANPort: 4789}
	for i := range 2 {
		if _, err := Join(context.Background(), s, small, cluster.Host{Name: fmt.Sprint("h", i)}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Join(context.Background(), s, small, cluster.Host{Name: "h9"}); !errors.Is(err, ErrExhausted) {
		t.Fatalf("third join: %v, want ErrExhausted", err)
	}
}

func TestAllocateNeverTwice(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	subnet := netip.MustParsePrefix("10.244.7.0/28") // 13 container addresses
	var wg sync.WaitGroup
	var mu sync.Mutex
	got := map[netip.Addr]string{}
	for i := range 13 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e, err := Allocate(ctx, s, subnet, cluster.Endpoint{Host: "h1", ContainerID: fmt.Sprint("c", i), IfName: "eth0"})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Error(err)
				return
			}
			if prev, dup := got[e.IP.Addr()]; dup {
				t.Errorf("%s handed to %s and %s", e.IP, prev, e.ContainerID)
			}
			got[e.IP.Addr()] = e.ContainerID
		}()
	}
	wg.Wait()
	if _, err := Allocate(ctx, s, subnet, cluster.Endpoint{Host: "h1", ContainerID: "full", IfName: "eth0"}); !errors.Is(err, ErrExhausted) {
		t.Fatalf("allocation in a full subnet: %v", err)
	}
	// Idempotent: asking again for an existing endpoint returns its address.
	e5, err := Allocate(ctx, s, subnet, cluster.Endpoint{Host: "h1", ContainerID: "c5", IfName: "eth0"})
	if err != nil || got[e5.IP.Addr()] != "c5" {
		t.Fatalf("re-allocate c5: %v %v", e5, err)
	}
	// Release frees exactly that address, and the next allocation reuses it only
	// because it is the only one free.
	if err := Release(ctx, s, e5); err != nil {
		t.Fatal(err)
	}
	if err := Release(ctx, s, e5); err != nil {
		t.Fatalf("second release: %v", err)
	}
	n, err := Allocate(ctx, s, subnet, cluster.Endpoint{Host: "h1", ContainerID: "new", IfName: "eth0"})
	if err != nil || n.IP != e5.IP {
		t.Fatalf("allocate after release: %v %v, want %v", n.IP, err, e5.IP)
	}
}

func TestAllocateRoundRobin(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	subnet := netip.MustParsePrefix("10.244.8.0/24")
	a, _ := Allocate(ctx, s, subnet, cluster.Endpoint{Host: "h1", ContainerID: "a", IfName: "eth0"})
	if err := Release(ctx, s, a); err != nil {
		t.Fatal(err)
	}
	b, _ := Allocate(ctx, s, subnet, cluster.Endpoint{Host: "h1", ContainerID: "b", IfName: "eth0"})
	if a.IP == b.IP {
		t.Fatalf("released address %v handed out again at once", a.IP)
	}
}

func TestAllocationSurvivesReconnect(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	subnet := netip.MustParsePrefix("10.244.9.0/24")
	a, err := Allocate(ctx, s, subnet, cluster.Endpoint{Host: "h1", ContainerID: "a", IfName: "eth0"})
	if err != nil {
		t.Fatal(err)
	}
	// A restarted agent is a new client: the lease is still there.
	s2, err := store.Open(s.Client.Endpoints(), s.TLS())
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	b, err := Allocate(ctx, s2, subnet, cluster.Endpoint{Host: "h1", ContainerID: "b", IfName: "eth0"})
	if err != nil || b.IP == a.IP {
		t.Fatalf("after reconnect got %v (%v), a has %v", b.IP, err, a.IP)
	}
}

// TestAllocateAsked: an address the runtime asks for (CNI ips, IP=) is
// given when it is free and the subnet's; another container's, the
// gateway, the subnet's own or another subnet's address is an error; the
// container asking again gets it again, and for another address an error.
func TestAllocateAsked(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	subnet := netip.MustParsePrefix("10.244.7.0/24")
	ask := func(id, addr string) (cluster.Endpoint, error) {
		return Allocate(ctx, s, subnet, cluster.Endpoint{Host: "h1", ContainerID: id, IfName: "eth0",
			IP: netip.PrefixFrom(netip.MustParseAddr(addr), 32)})
	}
	e, err := ask("a", "10.244.7.77")
	if err != nil || e.IP != netip.MustParsePrefix("10.244.7.77/24") {
		t.Fatalf("asked for .77: %v %v", e.IP, err)
	}
	if again, err := ask("a", "10.244.7.77"); err != nil || again.IP != e.IP {
		t.Errorf("asked again: %v %v", again.IP, err)
	}
	if _, err := ask("a", "10.244.7.78"); !errors.Is(err, ErrInUse) {
		t.Errorf("a asks for another address: %v, want ErrInUse", err)
	}
	if _, err := ask("b", "10.244.7.77"); !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "10.244.7.77") {
		t.Errorf("b asks for a's address: %v, want ErrInUse", err)
	}
	for _, addr := range []string{"10.244.7.0", "10.244.7.1", "10.244.7.255", "10.244.8.5"} {
		if _, err := ask("c", addr); !errors.Is(err, ErrNotInSubnet) {
			t.Errorf("asked for %s: %v, want ErrNotInSubnet", addr, err)
		}
	}
	// The round-robin is not moved by an asked-for address.
	n, err := Allocate(ctx, s, subnet, cluster.Endpoint{Host: "h1", ContainerID: "d", IfName: "eth0"})
	if err != nil || n.IP.Addr() != netip.MustParseAddr("10.244.7.2") {
		t.Errorf("next free after an asked-for address: %v %v, want 10.244.7.2", n.IP, err)
	}
}

// TestAllocateAll: endpoints allocated together get distinct addresses in
// one step each, an asked-for address among them included; the ones that
// cannot be allocated (twice in the batch, another host's, outside the
// subnet, a taken address, a full subnet) fail alone; batches racing each
// other never hand out one address twice; and an existing endpoint comes
// back unchanged.
func TestAllocateAll(t *testing.T) {
	s, _ := storetest.New(t)
	ctx := context.Background()
	subnet := netip.MustParsePrefix("10.244.7.0/26") // 61 container addresses
	ep := func(id string) cluster.Endpoint { return cluster.Endpoint{Host: "h1", ContainerID: id, IfName: "eth0"} }
	asked := ep("asked")
	asked.IP = netip.MustParsePrefix("10.244.7.9/32")
	other := ep("other")
	other.Host = "h2"
	outside := ep("outside")
	outside.IP = netip.MustParsePrefix("10.244.8.9/32")
	taken := ep("taken")
	taken.IP = asked.IP
	batch := []cluster.Endpoint{ep("a"), asked, ep("b"), ep("a"), other, outside, taken}
	out, errs := AllocateAll(ctx, s, subnet, batch)
	for i, wantErr := range []bool{false, false, false, true, true, true, true} {
		if (errs[i] != nil) != wantErr {
			t.Errorf("%s: err %v", batch[i].ContainerID, errs[i])
		}
	}
	if out[1].IP.Addr() != asked.IP.Addr() || out[0].IP == out[2].IP || out[0].IP.Addr() == asked.IP.Addr() || out[2].IP.Addr() == asked.IP.Addr() {
		t.Errorf("addresses %v %v %v", out[0].IP, out[1].IP, out[2].IP)
	}
	if !errors.Is(errs[5], ErrNotInSubnet) || !errors.Is(errs[6], ErrInUse) {
		t.Errorf("errors %v, %v", errs[5], errs[6])
	}
	// three batches at once fill the rest of the subnet (58 addresses)
	var mu sync.Mutex
	got := map[netip.Addr]string{out[0].IP.Addr(): "a", out[1].IP.Addr(): "asked", out[2].IP.Addr(): "b"}
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Go(func() {
			var es []cluster.Endpoint
			for i := range 20 {
				es = append(es, ep(fmt.Sprintf("g%d-%d", g, i)))
			}
			out, errs := AllocateAll(ctx, s, subnet, es)
			mu.Lock()
			defer mu.Unlock()
			for i := range es {
				if errs[i] != nil {
					if !errors.Is(errs[i], ErrExhausted) {
						t.Errorf("%s: %v", es[i].ContainerID, errs[i])
					}
					continue
				}
				if prev, dup := got[out[i].IP.Addr()]; dup {
					t.Errorf("%s handed to %s and %s", out[i].IP, prev, es[i].ContainerID)
				}
				got[out[i].IP.Addr()] = es[i].ContainerID
			}
		})
	}
	wg.Wait()
	if len(got) != 61 {
		t.Errorf("%d addresses handed out, want all 61", len(got))
	}
	again, errs := AllocateAll(ctx, s, subnet, []cluster.Endpoint{ep("b")})
	if errs[0] != nil || again[0].IP != out[2].IP || !again[0].Created.Equal(out[2].Created) {
		t.Errorf("b again: %v %v, want %v", again[0], errs[0], out[2])
	}
}
