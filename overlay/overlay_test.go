package overlay

import (
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/iptables"
	"github.com/skiffnet/skiff/policy"
)

// inTestNetns runs f on a locked thread inside a fresh, named network
// namespace holding an underlay "ul0" with 192.0.2.1/24; the namespace
// is deleted afterwards.
func inTestNetns(t *testing.T, f func()) {
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	name := "skiff-test-overlay"
	exec.Command("ip", "netns", "del", name).Run()
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		ns, err := netns.GetFromName(name)
		if err != nil {
			t.Error(err)
			return
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			t.Error(err)
			return
		}
		// A veth, not a dummy: this kernel has no dummy driver.
		ul := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ul0", MTU: 1500}, PeerName: "ul0p"}
		if err := netlink.LinkAdd(ul); err != nil {
			t.Error(err)
			return
		}
		netlink.AddrAdd(ul, &netlink.Addr{IPNet: prefixNet(netip.MustParsePrefix("192.0.2.1/24"))})
		netlink.LinkSetUp(ul)
		f()
	}()
	<-done
}

var testCluster = cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: 42, VXLANPort: 4789}

func host(name, ul, subnet string) cluster.Host {
	ip := netip.MustParseAddr(ul)
	return cluster.Host{Name: name, UnderlayIP: ip, Subnet: netip.MustParsePrefix(subnet), VTEPMAC: VTEPMAC(ip).String()}
}

// Timers count down, and an IPv6 link-local address stays "tentative" until
// duplicate address detection ends, whenever that is.
var timers = regexp.MustCompile(`_timer +[0-9.]+| tentative`)

func dump(t *testing.T) string {
	var b strings.Builder
	for _, args := range [][]string{
		{"ip", "-d", "link", "show"}, {"ip", "addr"}, {"ip", "route"}, {"ip", "neigh", "show", "dev", VXLANName},
		{"bridge", "fdb", "show", "dev", VXLANName}, {"iptables-save"},
	} {
		out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
		if err != nil {
			t.Errorf("%v: %v %s", args, err, out)
		}
		// Counters, timers, timestamps and DAD change by themselves; compare state only.
		for _, line := range strings.Split(timers.ReplaceAllString(string(out), ""), "\n") {
			if !strings.HasPrefix(line, "#") && !strings.Contains(line, "[") {
				b.WriteString(line + "\n")
			}
		}
	}
	return b.String()
}

func TestSetupIsIdempotentAndPrunes(t *testing.T) {
	inTestNetns(t, func() {
		me := host("h1", "192.0.2.1", "10.244.1.0/24")
		pins := bpffstest.Dir(t)
		o, err := New(Config{Cluster: testCluster, Host: me, Underlay: "ul0", PinDir: pins}, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		if o.MTU() != 1450 {
			t.Errorf("MTU %d, want 1450", o.MTU())
		}
		remotes := []cluster.Host{me, host("h2", "192.0.2.2", "10.244.2.0/24"), host("h3", "192.0.2.3", "10.244.3.0/24")}
		rules, _ := policy.NewSet([]policy.Rule{{ID: "r", Action: policy.Deny, Proto: policy.TCP, Port: 80}})
		apply := func() {
			if err := o.Setup(); err != nil {
				t.Fatal(err)
			}
			if err := o.SyncHosts(remotes); err != nil {
				t.Fatal(err)
			}
			if err := o.SyncPolicy(rules, nil); err != nil {
				t.Fatal(err)
			}
		}
		apply()
		first := dump(t)
		for _, want := range []string{"vxlan id 42", "noudpcsum", "10.244.2.0/24 via 10.244.2.0 dev skiff.vxlan onlink", "10.244.3.0 lladdr 0e:5f:c0:00:02:03 PERMANENT",
			"0e:5f:c0:00:02:02 dst 192.0.2.2 self permanent", "--dport 80", "10.244.1.1/24"} {
			if !strings.Contains(first, want) {
				t.Errorf("state lacks %q:\n%s", want, first)
			}
		}
		apply()
		if second := dump(t); second != first {
			t.Errorf("second reconcile changed state:\n--- first\n%s\n--- second\n%s", first, second)
		}
		// h3 leaves: everything pointing at it goes, h2 stays.
		remotes = remotes[:2]
		if err := o.SyncHosts(remotes); err != nil {
			t.Fatal(err)
		}
		after := dump(t)
		for _, gone := range []string{"10.244.3.0/24", "192.0.2.3", "0e:5f:c0:00:02:03"} {
			if strings.Contains(after, gone) {
				t.Errorf("%s still present after h3 left:\n%s", gone, after)
			}
		}
		if !strings.Contains(after, "10.244.2.0/24 via") {
			t.Error("h2's route went too")
		}
		// A veth of skiff's with no endpoint is removed; others are not.
		for _, name := range []string{VethName("gone", "eth0"), "other0"} {
			if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}); err != nil {
				t.Fatal(err)
			}
		}
		if err := o.PruneEndpoints(nil); err != nil {
			t.Fatal(err)
		}
		if _, err := netlink.LinkByName(VethName("gone", "eth0")); err == nil {
			t.Error("stale skiff veth survived")
		}
		if _, err := netlink.LinkByName("other0"); err != nil {
			t.Error("a veth that is not skiff's was removed")
		}
		// A VXLAN device with the wrong VNI is replaced.
		c := testCluster
		c.VNI = 43
		o2, _ := New(Config{Cluster: c, Host: me, Underlay: "ul0", PinDir: pins}, o.log)
		if err := o2.Setup(); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(dump(t), "vxlan id 43") {
			t.Error("VXLAN device not re-created with the new VNI")
		}
	})
}

func TestPolicyRules(t *testing.T) {
	set, _ := policy.NewSet([]policy.Rule{
		{ID: "b", Priority: 2, Action: policy.Deny, Src: netip.MustParsePrefix("10.244.1.0/24"), Proto: policy.UDP, Port: 53},
		{ID: "a", Priority: 1, Action: policy.Allow, Dst: netip.MustParsePrefix("10.244.2.7/32")},
		{ID: "c", Priority: 3, Action: policy.Allow, Proto: policy.TCP, Port: 30000, PortEnd: 32767},
	})
	got := strings.Join(PolicyRules(set), "\n")
	want := `-A SKIFF-POLICY -d 10.244.2.7/32 -m comment --comment "skiff policy a" -j ACCEPT
-A SKIFF-POLICY -s 10.244.1.0/24 -p udp --dport 53 -m comment --comment "skiff policy b" -j SKIFF-DENY
-A SKIFF-POLICY -p tcp --dport 30000:32767 -m comment --comment "skiff policy c" -j ACCEPT`
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

func TestVethNameFitsIFNAMSIZ(t *testing.T) {
	n := VethName(strings.Repeat("x", 200), "eth0")
	if len(n) > 15 || !strings.HasPrefix(n, VethPrefix) || n == VethName("y", "eth0") {
		t.Errorf("veth name %q", n)
	}
}

// TestJudgeInput: marked packets are judged by SKIFF-FORWARD; the rule is
// idempotent; denied marked packets get a reset before the deny chain's
// ICMP error; UnjudgeInput removes the rule and the reset.
func TestJudgeInput(t *testing.T) {
	const mark = 0x5c1ff
	inTestNetns(t, func() {
		chain := func(name string) string {
			out, _ := exec.Command("iptables", "-S", name).CombinedOutput()
			return strings.TrimSpace(string(out))
		}
		for _, err := range []error{
			iptables.NewChain("filter", chainForward),
			iptables.NewChain("filter", chainDeny),
			iptables.Append("filter", chainDeny, denyRule...),
		} {
			if err != nil {
				t.Error(err)
				return
			}
		}
		wantInput := "-P INPUT ACCEPT\n-A INPUT -m mark --mark 0x5c1ff -m comment --comment \"skiff overlay to host stack\" -j SKIFF-FORWARD"
		deny := "-A SKIFF-DENY -m comment --comment \"skiff policy deny\" -j REJECT --reject-with icmp-admin-prohibited"
		wantDeny := "-N SKIFF-DENY\n-A SKIFF-DENY -p tcp -m mark --mark 0x5c1ff -m comment --comment \"skiff deny to host stack\" -j REJECT --reject-with tcp-reset\n" + deny
		for i := 0; i < 2; i++ {
			if err := JudgeInput(mark); err != nil {
				t.Error(err)
			}
			for name, want := range map[string]string{"INPUT": wantInput, chainDeny: wantDeny} {
				if got := chain(name); got != want {
					t.Errorf("%s after JudgeInput #%d:\n%s\nwant\n%s", name, i+1, got, want)
				}
			}
		}
		UnjudgeInput(mark)
		if got := chain("INPUT"); got != "-P INPUT ACCEPT" {
			t.Errorf("INPUT after UnjudgeInput:\n%s", got)
		}
		if got := chain(chainDeny); got != "-N SKIFF-DENY\n"+deny {
			t.Errorf("%s after UnjudgeInput:\n%s", chainDeny, got)
		}
	})
}

// TestBroadcastRules: each local container's copy of a broadcast is
// judged by the rules whose destination covers it, in order, then
// accepted.
func TestBroadcastRules(t *testing.T) {
	set, _ := policy.NewSet([]policy.Rule{
		{ID: "deny-c2", Priority: 1, Action: policy.Deny, Src: netip.MustParsePrefix("10.244.1.2/32"), Dst: netip.MustParsePrefix("10.244.1.3/32"), Proto: policy.UDP},
		{ID: "elsewhere", Priority: 2, Action: policy.Deny, Dst: netip.MustParsePrefix("10.244.9.0/24")},
		{ID: "allow-dns", Priority: 3, Action: policy.Allow, Proto: policy.UDP, Port: 53},
	})
	local := []cluster.Endpoint{
		{Veth: "skfa", IP: netip.MustParsePrefix("10.244.1.2/32")},
		{Veth: "skfb", IP: netip.MustParsePrefix("10.244.1.3/32")},
	}
	want := []string{
		`-A SKIFF-BCAST -m physdev --physdev-out skfa -p udp --dport 53 -m comment --comment "skiff policy allow-dns" -j ACCEPT`,
		`-A SKIFF-BCAST -m physdev --physdev-out skfa -j ACCEPT`,
		`-A SKIFF-BCAST -m physdev --physdev-out skfb -s 10.244.1.2/32 -p udp -m comment --comment "skiff policy deny-c2" -j DROP`,
		`-A SKIFF-BCAST -m physdev --physdev-out skfb -p udp --dport 53 -m comment --comment "skiff policy allow-dns" -j ACCEPT`,
		`-A SKIFF-BCAST -m physdev --physdev-out skfb -j ACCEPT`,
	}
	if got := BroadcastRules(set, local); !slices.Equal(got, want) {
		t.Errorf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestDeniedFlowsAfterDNAT: a policy change ends a conntrack flow by where
// its first packet went after DNAT (a Service's backend), as the policy
// chain judged it, not by the address the client dialled.
func TestDeniedFlowsAfterDNAT(t *testing.T) {
	client, vip, backend := net.ParseIP("10.244.1.5"), net.ParseIP("10.96.0.10"), net.ParseIP("10.244.2.7")
	natted := &netlink.ConntrackFlow{
		Forward: netlink.IPTuple{SrcIP: client, DstIP: vip, SrcPort: 40000, DstPort: 53, Protocol: unix.IPPROTO_UDP},
		Reverse: netlink.IPTuple{SrcIP: backend, DstIP: client, SrcPort: 5353, DstPort: 40000, Protocol: unix.IPPROTO_UDP},
	}
	plain := &netlink.ConntrackFlow{
		Forward: netlink.IPTuple{SrcIP: client, DstIP: backend, SrcPort: 40001, DstPort: 5353, Protocol: unix.IPPROTO_UDP},
		Reverse: netlink.IPTuple{SrcIP: backend, DstIP: client, SrcPort: 5353, DstPort: 40001, Protocol: unix.IPPROTO_UDP},
	}
	rule := func(dst string, port uint16) policy.Set {
		set, err := policy.NewSet([]policy.Rule{{ID: "r", Action: policy.Deny, Dst: netip.MustParsePrefix(dst), Proto: policy.UDP, Port: port}})
		if err != nil {
			t.Fatal(err)
		}
		return set
	}
	cidr := netip.MustParsePrefix("10.244.0.0/16")
	for _, tc := range []struct {
		name string
		set  policy.Set
		flow *netlink.ConntrackFlow
		want bool
	}{
		{"backend denied, through the VIP", rule("10.244.2.7/32", 5353), natted, true},
		{"backend denied, directly", rule("10.244.2.7/32", 5353), plain, true},
		{"the VIP's port named: never judged", rule("10.96.0.10/32", 53), natted, false},
		{"another backend port", rule("10.244.2.7/32", 53), natted, false},
	} {
		if got := (deniedFlows{tc.set, cidr}).MatchConntrackFlow(tc.flow); got != tc.want {
			t.Errorf("%s: matched %v, want %v", tc.name, got, tc.want)
		}
	}
}
