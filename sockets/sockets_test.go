package sockets

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/tc/tctest"
)

var testHost = cluster.Host{
	Name: "h1", UnderlayIP: netip.MustParseAddr("10.99.0.1"),
	Subnet: netip.MustParsePrefix("10.244.1.0/24"),
}

var testCluster = cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: 1, VXLANPort: 4789}

// loadTest loads the programs (verifier included) with maps pinned in a
// private bpffs directory, without attaching them.
func loadTest(t *testing.T) *dataPlane { return loadTestTB(t) }

func loadTestTB(t testing.TB) *dataPlane {
	t.Helper()
	dir := bpffstest.Dir(t)
	l, err := load(Config{Cluster: testCluster, Host: testHost, Underlay: "lo", PinDir: dir, Secure: true,
		StateDir: t.TempDir(), Broker: filepath.Join(t.TempDir(), "skiff-broker")},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// TestReloadKeepsMaps: the same version loaded again (an agent restart)
// finds every pinned map compatible, layouts included, and keeps what they
// hold, the policy's inner map too.
func TestReloadKeepsMaps(t *testing.T) {
	l := loadTest(t)
	if err := l.objs.SksServed.Put(bpfmap.IPv4(ipServer), uint8(1)); err != nil {
		t.Fatal(err)
	}
	if err := l.Sync([]cluster.Host{testHost}, nil, nil); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	again, err := load(l.cfg, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	var yes uint8
	if err := again.objs.SksServed.Lookup(bpfmap.IPv4(ipServer), &yes); err != nil || logs.Len() != 0 {
		t.Fatalf("reload lost sks_served (%v); log %q", err, logs.String())
	}
	if r, err := again.inForce(); err != nil || r == nil {
		t.Fatalf("reload lost the policy: %v", err)
	}
}

func TestLoad(t *testing.T) {
	l := loadTest(t)
	st, err := l.Stats()
	if err != nil {
		t.Fatal(err)
	}
	limited := 0
	for name := range st {
		if strings.HasPrefix(name, "limit_") {
			limited++
		}
	}
	if len(st)-limited != len(Reasons()) || limited == 0 {
		t.Fatalf("%d counters (%d of limits), want %d and those of limits", len(st), limited, len(Reasons()))
	}
}

func TestSyncRoutes(t *testing.T) {
	l := loadTest(t)
	peer := cluster.Host{Name: "h2", UnderlayIP: netip.MustParseAddr("10.99.0.2"), Subnet: netip.MustParsePrefix("10.244.2.0/24")}
	hosts := []cluster.Host{testHost, peer}
	remote := cluster.Listener{Host: "h2", Addr: netip.MustParseAddrPort("10.244.2.9:80")}
	local := cluster.Listener{Host: "h1", Addr: netip.MustParseAddrPort("10.244.1.6:8080")}
	gone := cluster.Listener{Host: "h9", Addr: netip.MustParseAddrPort("10.244.9.9:80")} // host left
	deny := policy.Rule{ID: "x", Action: policy.Deny, Src: netip.MustParsePrefix("10.244.1.5/32"),
		Dst: netip.MustParsePrefix("10.244.2.9/32"), Proto: policy.TCP, Port: 80}
	rules, err := policy.NewSet([]policy.Rule{deny})
	if err != nil {
		t.Fatal(err)
	}
	routes := func() map[string]netip.Addr {
		out := map[string]netip.Addr{}
		var k sksSksKey
		var v uint32
		it := l.objs.SksRoutes.Iterate()
		for it.Next(&k, &v) {
			out[fmt.Sprintf("%s:%d", bpfmap.Addr(k.Ip), portOf(k.Port))] = bpfmap.Addr(v)
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
	if got := inForce(t, l); got != nil {
		t.Fatalf("a policy before the first sync: %+v", got)
	}
	if err := l.Sync(hosts, []cluster.Listener{remote, local, gone}, rules); err != nil {
		t.Fatal(err)
	}
	// Nothing to the listener whose host is gone.
	want := map[string]netip.Addr{"10.244.2.9:80": peer.UnderlayIP, "10.244.1.6:8080": testHost.UnderlayIP}
	if got := routes(); !maps.Equal(got, want) {
		t.Fatalf("routes %v, want %v", got, want)
	}
	if got := inForce(t, l); got == nil || *got != *tcpRules(rules) {
		t.Fatalf("policy in force %+v, want the rule", got)
	}
	var owner uint32
	if err := l.objs.SksSubnets.Lookup(sksSksSubnet{Prefixlen: 32, Ip: bpfmap.IPv4(netip.MustParseAddr("10.244.2.200"))}, &owner); err != nil || bpfmap.Addr(owner) != peer.UnderlayIP {
		t.Fatalf("subnet owner of 10.244.2.200: %v %v", bpfmap.Addr(owner), err)
	}
	// The rule goes, the host goes: routes and policy follow.
	if err := l.Sync([]cluster.Host{testHost}, []cluster.Listener{remote, local}, nil); err != nil {
		t.Fatal(err)
	}
	if got := routes(); !maps.Equal(got, map[string]netip.Addr{"10.244.1.6:8080": testHost.UnderlayIP}) {
		t.Fatalf("after the change: %v", got)
	}
	if got := inForce(t, l); got == nil || got.N != 0 || got.Overflow != 0 {
		t.Fatalf("policy in force %+v, want none", got)
	}
	if err := l.objs.SksSubnets.Lookup(sksSksSubnet{Prefixlen: 32, Ip: bpfmap.IPv4(netip.MustParseAddr("10.244.2.200"))}, &owner); err == nil {
		t.Fatal("the departed host still owns its subnet")
	}
}

// TestSyncRoutesFull: more listeners than sks_routes holds, nearly all of
// two containers'. Each container gets an equal share of the routes (the
// others take the overlay): the small ones keep all of theirs, the large
// ones their lowest ports, and the map is full, without an error.
func TestSyncRoutesFull(t *testing.T) {
	l := loadTest(t)
	peer := cluster.Host{Name: "h2", UnderlayIP: netip.MustParseAddr("10.99.0.2"), Subnet: netip.MustParsePrefix("10.244.2.0/24")}
	size := int(l.objs.SksRoutes.MaxEntries())
	var listeners []cluster.Listener
	for _, hog := range []string{"10.244.2.2", "10.244.2.5"} {
		for i := range size/2 + 5 {
			listeners = append(listeners, cluster.Listener{Host: "h2", Addr: netip.AddrPortFrom(netip.MustParseAddr(hog), uint16(1000+i))})
		}
	}
	for _, a := range []string{"10.244.2.3", "10.244.2.4"} {
		listeners = append(listeners, cluster.Listener{Host: "h2", Addr: netip.MustParseAddrPort(a + ":80")})
	}
	if err := l.Sync([]cluster.Host{testHost, peer}, listeners, nil); err != nil {
		t.Fatal(err)
	}
	got, err := bpfmap.Entries[sksSksKey, uint32](l.objs.SksRoutes)
	if err != nil || len(got) != size {
		t.Fatalf("%d routes (%v), want %d", len(got), err, size)
	}
	for _, a := range []string{"10.244.2.3:80", "10.244.2.4:80", "10.244.2.2:1000", "10.244.2.5:1000"} {
		ap := netip.MustParseAddrPort(a)
		if _, ok := got[sksSksKey{Ip: bpfmap.IPv4(ap.Addr()), Port: bpfmap.Port(ap.Port())}]; !ok {
			t.Errorf("no route to %s", a)
		}
	}
	if n := l.routesOver.Load(); n != 12 {
		t.Errorf("%d listeners without a route, want 12", n)
	}
}

func TestFairShare(t *testing.T) {
	var ls []cluster.Listener
	add := func(addr string, n int) {
		for i := range n {
			ls = append(ls, cluster.Listener{Addr: netip.AddrPortFrom(netip.MustParseAddr(addr), uint16(100+i))})
		}
	}
	add("10.0.0.1", 50)
	add("10.0.0.2", 3)
	add("10.0.0.3", 20)
	add("10.0.0.4", 9)
	for _, tc := range []struct {
		capacity int
		want     map[string]int // kept, by address
	}{
		{100, map[string]int{"10.0.0.1": 50, "10.0.0.2": 3, "10.0.0.3": 20, "10.0.0.4": 9}},
		{40, map[string]int{"10.0.0.1": 14, "10.0.0.2": 3, "10.0.0.3": 14, "10.0.0.4": 9}},
		{8, map[string]int{"10.0.0.1": 2, "10.0.0.2": 2, "10.0.0.3": 2, "10.0.0.4": 2}},
		{2, map[string]int{"10.0.0.1": 1, "10.0.0.3": 1}}, // the largest two; the rest none
	} {
		kept, over := fairShare(ls, tc.capacity)
		got := map[string]int{}
		for _, li := range kept {
			got[li.Addr.Addr().String()]++
			if li.Addr.Port() >= uint16(100+got[li.Addr.Addr().String()]) {
				t.Errorf("capacity %d: %s kept, not one of its lowest ports", tc.capacity, li.Addr)
			}
		}
		if !maps.Equal(got, tc.want) || over != len(ls)-len(kept) {
			t.Errorf("capacity %d: kept %v (%d over), want %v", tc.capacity, got, over, tc.want)
		}
	}
}

// inForce reads the policy connect4 judges by: nil while there is none.
func inForce(t *testing.T, l *dataPlane) *sksSksRules {
	t.Helper()
	r, err := l.inForce()
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestTCPRules(t *testing.T) {
	pfx := netip.MustParsePrefix
	set, err := policy.NewSet([]policy.Rule{
		{ID: "a", Priority: 1, Action: policy.Deny, Src: pfx("10.244.1.0/24"), Dst: pfx("10.244.2.9/32"), Proto: policy.TCP, Port: 80},
		{ID: "b", Priority: 2, Action: policy.Allow, Proto: policy.UDP, Port: 53}, // never a TCP connection
		{ID: "c", Priority: 3, Action: policy.Allow, Dst: pfx("10.244.0.0/16")},   // any protocol
		{ID: "d", Priority: 4, Action: policy.Deny, Proto: policy.ICMP},
	})
	if err != nil {
		t.Fatal(err)
	}
	got := tcpRules(set)
	be := func(s string) uint32 { return bpfmap.IPv4(netip.MustParseAddr(s)) }
	want := []sksSksRule{
		{Src: be("10.244.1.0"), SrcMask: be("255.255.255.0"), Dst: be("10.244.2.9"), DstMask: be("255.255.255.255"), Port: bpfmap.Port(80), PortMask: 0xffff},
		{Dst: be("10.244.0.0"), DstMask: be("255.255.0.0"), Allow: 1},
	}
	if got.N != uint32(len(want)) || got.Overflow != 0 || !slices.Equal(got.Rules[:got.N], want) {
		t.Fatalf("rendered %d rules (overflow %d): %+v, want %+v", got.N, got.Overflow, got.Rules[:got.N], want)
	}
	// One rule more than fits: the fast path judges none of them.
	var many []policy.Rule
	for i := range len(got.Rules) + 1 {
		many = append(many, policy.Rule{ID: fmt.Sprintf("r%04d", i), Action: policy.Deny, Proto: policy.TCP, Port: uint16(i + 1)})
	}
	big, err := policy.NewSet(many)
	if err != nil {
		t.Fatal(err)
	}
	if r := tcpRules(big); r.Overflow != 1 || int(r.N) != len(r.Rules) {
		t.Fatalf("%d rules: n %d overflow %d", len(many), r.N, r.Overflow)
	}
	if r := tcpRules(big[:len(got.Rules)]); r.Overflow != 0 {
		t.Fatalf("%d rules overflow", len(got.Rules))
	}
}

// TestPortBlocks: a range's blocks cover exactly its ports, and no two
// overlap.
func TestPortBlocks(t *testing.T) {
	for _, r := range [][2]uint16{{80, 80}, {79, 84}, {1, 65535}, {30000, 32767}, {1024, 2047}, {65535, 65535}, {5, 6}} {
		bs := portBlocks(r[0], r[1])
		for p := 1; p <= 65535; p++ {
			n := 0
			for _, b := range bs {
				if uint16(p)&b.mask == b.port {
					n++
				}
			}
			if in := p >= int(r[0]) && p <= int(r[1]); n != map[bool]int{true: 1, false: 0}[in] {
				t.Fatalf("%d-%d: port %d in %d blocks of %v", r[0], r[1], p, n, bs)
			}
		}
		if len(bs) > 30 {
			t.Errorf("%d-%d: %d blocks", r[0], r[1], len(bs))
		}
	}
	if bs := portBlocks(0, 0); len(bs) != 1 || bs[0].mask != 0 {
		t.Errorf("any port: %v", bs)
	}
}

func TestConnFlow(t *testing.T) {
	ap := netip.MustParseAddrPort
	cases := []struct {
		c    conn
		want policy.Flow
	}{
		{conn{Role: sksSksRoleSKS_CLIENT, Local: ap("10.244.1.5:0"), Peer: ap("10.244.2.9:80")},
			policy.Flow{Src: ap("10.244.1.5:0").Addr(), Dst: ap("10.244.2.9:0").Addr(), Proto: policy.TCP, Port: 80}},
		{conn{Role: sksSksRoleSKS_CHILD, Local: ap("10.244.1.5:8080"), Peer: ap("10.244.2.9:0")},
			policy.Flow{Src: ap("10.244.2.9:0").Addr(), Dst: ap("10.244.1.5:0").Addr(), Proto: policy.TCP, Port: 8080}},
		{conn{Role: sksSksRoleSKS_CLIENT, Local: ap("10.244.1.5:0"), Peer: ap("127.0.0.1:8080")}, // the container's own loopback
			policy.Flow{Src: ap("10.244.1.5:0").Addr(), Dst: ap("10.244.1.5:0").Addr(), Proto: policy.TCP, Port: 8080}},
	}
	for _, c := range cases {
		if got := c.c.flow(); got != c.want {
			t.Errorf("%+v: flow %+v, want %+v", c.c, got, c.want)
		}
	}
}

// TestDenied: a policy change ends the replaced connections it denies,
// except those whose peer is unknown or a host's own address (the host
// stack's connections, which the overlay's policy does not judge).
func TestDenied(t *testing.T) {
	l := &dataPlane{cfg: Config{Cluster: testCluster}}
	ap := netip.MustParseAddrPort
	rules, err := policy.NewSet([]policy.Rule{{ID: "deny", Action: policy.Deny, Src: netip.MustParsePrefix("10.244.0.0/16"),
		Dst: netip.MustParsePrefix("10.244.1.5/32"), Proto: policy.TCP}})
	if err != nil {
		t.Fatal(err)
	}
	child := func(peer string) conn {
		return conn{Role: sksSksRoleSKS_CHILD, Local: ap("10.244.1.5:8080"), Peer: ap(peer)}
	}
	for _, c := range []struct {
		name string
		c    conn
		want bool
	}{
		{"a container's connection", child("10.244.2.9:0"), true},
		{"the host's own (bridge)", child("10.244.1.1:0"), false},
		{"another host's (VXLAN device)", child("10.244.2.0:0"), false},
		{"unknown peer", child("0.0.0.0:0"), false},
		{"allowed", conn{Role: sksSksRoleSKS_CLIENT, Local: ap("10.244.1.5:0"), Peer: ap("10.244.2.9:80")}, false},
		{"a listener", conn{Role: sksSksRoleSKS_LISTEN, Local: ap("10.244.1.5:8080")}, false},
	} {
		if got := l.denied(rules, c.c); got != c.want {
			t.Errorf("%s: denied %v, want %v", c.name, got, c.want)
		}
	}
}

// TestReasonsMatchProgram: Reasons names every counter of enum sks_reason,
// in order.
func TestReasonsMatchProgram(t *testing.T) {
	if names := tctest.EnumNames(t, "sockets.h", "sks_reason", "SKS_"); !slices.Equal(names, Reasons()) {
		t.Fatalf("sockets.h: %v\nReasons:   %v", names, Reasons())
	}
}

// TestAcceptLocalRestored: Teardown gives lo's accept_local back the value
// the layer found, also across restarts of the layer. In a network
// namespace of its own (the test's thread, discarded at the end).
func TestAcceptLocalRestored(t *testing.T) {
	runtime.LockOSThread() // never unlocked: the thread ends with the test
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		t.Fatal(err)
	}
	read := func() string {
		v, err := os.ReadFile(acceptLocalLo)
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(v))
	}
	for _, earlier := range []string{"0", "1"} {
		if err := os.WriteFile(acceptLocalLo, []byte(earlier), 0o644); err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(t.TempDir(), "state")
		for range 2 { // a restarted agent sets it up again
			if err := acceptLocal(dir); err != nil {
				t.Fatal(err)
			}
			if v := read(); v != "1" {
				t.Fatalf("accept_local %s after setup", v)
			}
		}
		if err := restoreAcceptLocal(dir); err != nil {
			t.Fatal(err)
		}
		if v := read(); v != earlier {
			t.Fatalf("accept_local %s after teardown, was %s", v, earlier)
		}
		if err := os.WriteFile(acceptLocalLo, []byte("1"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := restoreAcceptLocal(dir); err != nil || read() != "1" {
			t.Fatalf("a second teardown changed it (%v): %s", err, read())
		}
	}
}

// TestServedForgottenWithContainer: a container's address stays served
// (its connections accepted from a replaced listener are the host stack's)
// until the last container with that address goes.
func TestServedForgottenWithContainer(t *testing.T) {
	l := loadTest(t)
	ip := bpfmap.IPv4(ipServer)
	for _, id := range []uint64{1, 2} {
		if err := l.objs.SksContainers.Put(id, sksSksContainer{Ip: ip}); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.objs.SksServed.Put(ip, uint8(1)); err != nil {
		t.Fatal(err)
	}
	served := func() bool {
		var v uint8
		return l.objs.SksServed.Lookup(ip, &v) == nil
	}
	if err := l.unpinCgroup(1); err != nil {
		t.Fatal(err)
	}
	if !served() {
		t.Fatal("address forgotten while another container has it")
	}
	if err := l.unpinCgroup(2); err != nil {
		t.Fatal(err)
	}
	if served() {
		t.Fatal("address still served after its last container")
	}
	if err := l.unpinCgroup(2); err != nil {
		t.Fatalf("second removal: %v", err)
	}
}

// BenchmarkSync is the agent's work per listener event in a cluster of 50
// hosts with 40 replaced listeners each and a policy of 20 rules: one
// Sync that finds the maps already right.
func BenchmarkSync(b *testing.B) {
	l := loadTestTB(b)
	var hosts []cluster.Host
	var listeners []cluster.Listener
	for h := range 50 {
		name := fmt.Sprintf("h%d", h)
		hosts = append(hosts, cluster.Host{Name: name, UnderlayIP: netip.AddrFrom4([4]byte{10, 99, 0, byte(h + 1)}),
			Subnet: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 244, byte(h), 0}), 24)})
		for c := range 40 {
			listeners = append(listeners, cluster.Listener{Host: name, Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(h), byte(c + 2)}), 8080)})
		}
	}
	var rules []policy.Rule
	for i := range 20 {
		rules = append(rules, policy.Rule{ID: fmt.Sprintf("r%d", i), Action: policy.Deny, Dst: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 250, byte(i), 0}), 24)})
	}
	set, err := policy.NewSet(rules)
	if err != nil {
		b.Fatal(err)
	}
	if err := l.Sync(hosts, listeners, set); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		if err := l.Sync(hosts, listeners, set); err != nil {
			b.Fatal(err)
		}
	}
}
