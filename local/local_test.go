package local

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/source"
)

var subnet = netip.MustParsePrefix("10.244.3.0/29") // container addresses .2 to .6

func open(t *testing.T, dir string) *Store {
	t.Helper()
	s, freed, err := Open(dir, "h1")
	if err != nil {
		t.Fatal(err)
	}
	if len(freed) != 0 {
		t.Fatalf("freed %v on a clean open", freed)
	}
	return s
}

func ep(id string) cluster.Endpoint {
	return cluster.Endpoint{Host: "h1", ContainerID: id, IfName: "eth0"}
}

// TestAllocate: addresses round-robin through the subnet's container
// addresses, an endpoint asked again keeps its own, an address asked for
// must be the subnet's and free, and a full subnet says so.
func TestAllocate(t *testing.T) {
	s := open(t, t.TempDir())
	var got []string
	for _, id := range []string{"a", "b", "c"} {
		e, err := s.Allocate(subnet, ep(id))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, e.IP.String())
	}
	if want := []string{"10.244.3.2/29", "10.244.3.3/29", "10.244.3.4/29"}; !slices.Equal(got, want) {
		t.Fatalf("allocated %v, want %v", got, want)
	}
	if again, err := s.Allocate(subnet, ep("a")); err != nil || again.IP.String() != "10.244.3.2/29" {
		t.Fatalf("again: %v %v", again.IP, err)
	}
	// Released addresses are not reused before the rest of the subnet.
	if err := s.Release(cluster.Endpoint{Host: "h1", ContainerID: "a", IfName: "eth0", IP: netip.MustParsePrefix("10.244.3.2/29")}); err != nil {
		t.Fatal(err)
	}
	if e, _ := s.Allocate(subnet, ep("d")); e.IP.String() != "10.244.3.5/29" {
		t.Fatalf("after a release: %v", e.IP)
	}
	asked := ep("e")
	for _, c := range []struct {
		ip   string
		want error
	}{
		{"10.244.3.3/29", source.ErrInUse},       // b's
		{"10.244.3.1/29", source.ErrNotInSubnet}, // the gateway
		{"10.244.3.7/29", source.ErrNotInSubnet}, // broadcast
		{"10.244.4.2/29", source.ErrNotInSubnet},
	} {
		asked.IP = netip.MustParsePrefix(c.ip)
		if _, err := s.Allocate(subnet, asked); !errors.Is(err, c.want) {
			t.Errorf("asked %s: %v, want %v", c.ip, err, c.want)
		}
	}
	asked.IP = netip.MustParsePrefix("10.244.3.2/29") // free again
	if e, err := s.Allocate(subnet, asked); err != nil || e.IP != asked.IP {
		t.Fatalf("asked a free address: %v %v", e.IP, err)
	}
	if _, err := s.Allocate(subnet, ep("f")); err != nil { // .6, the last
		t.Fatal(err)
	}
	if _, err := s.Allocate(subnet, ep("g")); !errors.Is(err, source.ErrExhausted) {
		t.Fatalf("full subnet: %v", err)
	}
	eps, err := s.Endpoints("")
	if err != nil || len(eps) != 5 {
		t.Fatalf("endpoints: %d %v", len(eps), err)
	}
	if other, _ := s.Endpoints("h2"); len(other) != 0 {
		t.Fatalf("another host's endpoints: %v", other)
	}
}

// TestEndpointRecords: an endpoint is read back as written; PutEndpoint
// changes only an endpoint that exists; a release frees only its own
// lease.
func TestEndpointRecords(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir)
	e, err := s.Allocate(subnet, ep("a"))
	if err != nil {
		t.Fatal(err)
	}
	e.MAC, e.Veth = "02:00:00:00:00:01", "skf1"
	if err := s.PutEndpoint(e); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Endpoint("h1", "a", "eth0"); err != nil || got.MAC != e.MAC || got.Veth != e.Veth || got.IP != e.IP {
		t.Fatalf("read back %+v, %v", got, err)
	}
	if err := s.PutEndpoint(ep("nope")); !errors.Is(err, source.ErrNotFound) {
		t.Fatalf("put of an unknown endpoint: %v", err)
	}
	if _, err := s.Endpoint("h1", "nope", "eth0"); !errors.Is(err, source.ErrNotFound) {
		t.Fatalf("unknown endpoint: %v", err)
	}
	// A stale release (another endpoint's address) frees nothing of a's.
	stale := ep("gone")
	stale.IP = e.IP
	if err := s.Release(stale); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "leases", e.IP.Addr().String())); err != nil {
		t.Fatalf("a's lease went with another's release: %v", err)
	}
	if err := s.Release(e); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(e); err != nil {
		t.Fatalf("releasing twice: %v", err)
	}
}

// TestOpenRepairs: leases left by an allocation cut short (no endpoint, or
// an empty lease file) are given back at the next open; an endpoint whose
// lease is gone takes it again.
func TestOpenRepairs(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir)
	a, _ := s.Allocate(subnet, ep("a"))
	b, _ := s.Allocate(subnet, ep("b"))
	// Cut short: a lease with no endpoint, an empty lease, and b's lease gone.
	os.WriteFile(filepath.Join(dir, "leases", "10.244.3.5"), []byte("x@eth0"), 0o600)
	os.WriteFile(filepath.Join(dir, "leases", "10.244.3.6"), nil, 0o600)
	os.Remove(filepath.Join(dir, "leases", b.IP.Addr().String()))
	s, freed, err := Open(dir, "h1")
	if err != nil {
		t.Fatal(err)
	}
	if len(freed) != 2 {
		t.Fatalf("freed %v, want .5 and .6", freed)
	}
	// Every address but a's and b's is free; neither is given again.
	seen := map[netip.Addr]bool{a.IP.Addr(): true, b.IP.Addr(): true}
	for _, id := range []string{"c", "d", "e"} {
		e, err := s.Allocate(subnet, ep(id))
		if err != nil {
			t.Fatal(err)
		}
		if seen[e.IP.Addr()] {
			t.Fatalf("%s given twice", e.IP)
		}
		seen[e.IP.Addr()] = true
	}
}

// TestConcurrentAllocate: concurrent allocations get distinct addresses.
func TestConcurrentAllocate(t *testing.T) {
	s := open(t, t.TempDir())
	big := netip.MustParsePrefix("10.244.3.0/24")
	var wg sync.WaitGroup
	got := make([]netip.Prefix, 100)
	for i := range got {
		wg.Go(func() {
			e, err := s.Allocate(big, ep(string(rune('a'+i%26))+string(rune('a'+i/26))))
			if err != nil {
				t.Error(err)
			}
			got[i] = e.IP
		})
	}
	wg.Wait()
	seen := map[netip.Prefix]bool{}
	for _, p := range got {
		if seen[p] {
			t.Fatalf("%s given twice", p)
		}
		seen[p] = true
	}
}
