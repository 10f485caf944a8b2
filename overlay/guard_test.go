package overlay

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/cluster"
)

func TestGuardRules(t *testing.T) {
	o := &Overlay{cfg: Config{
		Cluster: cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), VXLANPort: 4789},
		Host:    cluster.Host{Name: "h1", UnderlayIP: netip.MustParseAddr("10.99.0.1")},
	}}
	ap := netip.MustParseAddrPort
	cp := ControlPlane{Ports: []uint16{9473, 2379, 2380, 2379}, Endpoints: []netip.AddrPort{ap("10.99.0.254:2379"), ap("10.99.0.254:2380")}}
	hosts := []cluster.Host{
		o.cfg.Host,
		{Name: "h2", UnderlayIP: netip.MustParseAddr("10.99.0.2"), Subnet: netip.MustParsePrefix("10.244.2.0/24"), Control: []netip.AddrPort{ap("0.0.0.0:9473"), ap("127.0.0.1:2379"), ap("10.99.0.254:2379")}},
	}
	got := o.guardRules(cp, hosts)
	for _, want := range []string{
		"-A SKIFF-GUARD-IN -p udp --dport 4789 -j DROP\n",
		"-A SKIFF-GUARD-IN -p tcp -m multiport --dports 2379,2380,9473 -j REJECT --reject-with tcp-reset\n",
		"-A SKIFF-GUARD-FWD -d 10.244.0.0/16 -j RETURN\n-A SKIFF-GUARD-FWD -p udp --dport 4789 -j DROP\n",
		"-A SKIFF-GUARD-FWD -d 10.99.0.2/32 -p tcp --dport 9473 -j REJECT", // unspecified: the host's underlay address
		// h2 speaks for 10.244.2.0/24 only: an IPv4 frame with another
		// source in 10.244.0.0/16 is dropped, then the rest returns.
		`-A SKIFF-VXLAN -s 10.99.0.2/32 -m u32 --u32 "0>>22&0x3C@28>>16=0x0800&&0>>22&0x3C@42&0xffff0000=0x0af40000" ` +
			`-m u32 ! --u32 "0>>22&0x3C@28>>16=0x0800&&0>>22&0x3C@42&0xffffff00=0x0af40200" ` +
			`-m comment --comment "skiff: inner source of another host" -j DROP` + "\n" +
			"-A SKIFF-VXLAN -s 10.99.0.2/32 -j RETURN\n",
		"VXLAN only from cluster hosts\" -j DROP\nCOMMIT\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("rules lack %q:\n%s", want, got)
		}
	}
	for _, unwanted := range []string{"127.0.0.1", "-s 10.99.0.1/32"} { // loopback of another host; this host's own VXLAN
		if strings.Contains(got, unwanted) {
			t.Errorf("rules have %q:\n%s", unwanted, got)
		}
	}
	if n := strings.Count(got, "10.99.0.254/32 -p tcp --dport 2379"); n != 1 {
		t.Errorf("the store's endpoint %d times, want once:\n%s", n, got)
	}
}
