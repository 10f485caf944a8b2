package layer

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
)

// clusterOf returns a cluster state of n endpoints, built afresh each call
// as a reconcile reads it.
func clusterOf(n int) *View {
	created := time.Date(2026, 11, 23, 4, 0, 0, 0, time.UTC)
	in := &View{
		Rules: policy.Set{{ID: "deny-db", Action: policy.Deny, Dst: netip.MustParsePrefix("10.244.3.0/24"), Proto: "tcp", Port: 5432}},
		Hosts: []cluster.Host{{Name: "h1", UnderlayIP: netip.MustParseAddr("192.168.0.1"), Subnet: netip.MustParsePrefix("10.244.1.0/24")}},
	}
	for i := range n {
		in.Endpoints = append(in.Endpoints, cluster.Endpoint{
			ContainerID: fmt.Sprintf("c%d", i), IfName: "eth0", Host: fmt.Sprintf("h%d", i%100),
			IP:      netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)}), 24),
			Created: created.Add(time.Duration(i) * time.Second),
		})
	}
	return in
}

func TestViewSame(t *testing.T) {
	base := clusterOf(3)
	if base.Same(nil) {
		t.Fatal("equal to no earlier state")
	}
	if !base.Same(clusterOf(3)) {
		t.Fatal("the same state read again differs")
	}
	// A time decoded with an offset is another location, the same instant.
	elsewhere := clusterOf(3)
	elsewhere.Endpoints[1].Created = elsewhere.Endpoints[1].Created.In(time.FixedZone("CET", 3600))
	if !base.Same(elsewhere) {
		t.Fatal("the same instant in another location differs")
	}
	changes := map[string]func(*View){
		"endpoint IP":   func(c *View) { c.Endpoints[2].IP = netip.MustParsePrefix("10.244.9.9/24") },
		"endpoint gone": func(c *View) { c.Endpoints = c.Endpoints[:2] },
		"created":       func(c *View) { c.Endpoints[0].Created = c.Endpoints[0].Created.Add(time.Nanosecond) },
		"host":          func(c *View) { c.Hosts[0].VTEPMAC = "aa:bb:cc:dd:ee:ff" },
		"host added":    func(c *View) { c.Hosts = append(c.Hosts, cluster.Host{Name: "h2"}) },
		"rule":          func(c *View) { c.Rules[0].Port = 5433 },
		"no rules":      func(c *View) { c.Rules = nil },
	}
	for name, change := range changes {
		c := clusterOf(3)
		change(c)
		if base.Same(c) || c.Same(base) {
			t.Errorf("%s: a changed state compares equal", name)
		}
	}
}

// BenchmarkViewSame is the cache layer's test for "nothing to do"
// in a reconcile, on a cluster of 10 000 endpoints (it printed them all with
// fmt.Sprint before).
func BenchmarkViewSame(b *testing.B) {
	a, c := clusterOf(10000), clusterOf(10000)
	for b.Loop() {
		if !a.Same(c) {
			b.Fatal("differ")
		}
	}
}
