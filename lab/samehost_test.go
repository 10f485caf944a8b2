package lab

import (
	"context"
	"errors"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/policy"
)

// TestSameHostPolicy: a deny rule holds between two containers of one
// host (UDP and TCP), also after someone turned off the sysctl that passes
// bridged packets through iptables: the agent sets it again at its next
// reconcile and says so. Before, skiff neither set nor checked it, and
// with it off same-host deny rules did nothing.
func TestSameHostPolicy(t *testing.T) {
	l := newLab(t, Config{Name: "tsamepol", Hosts: 1, ContainersPerHost: 2, Mode: "overlay"})
	ctx := context.Background()
	dst, _ := l.IP("h1/c2")
	echoServer(t, l, "h1/c2", echoPort)
	to := netip.AddrPortFrom(dst, echoPort)
	for _, kind := range []string{"tcp4", "udp4"} {
		if _, err := eventually(10*time.Second, func() error { return roundTrips(l, "h1/c1", kind, to, 1) }); err != nil {
			t.Fatalf("%s before any rule: %v", kind, err)
		}
	}
	src, _ := l.IP("h1/c1")
	deny := policy.Rule{ID: "same-host", Priority: 1, Action: policy.Deny, Src: netip.PrefixFrom(src, 32), Dst: netip.PrefixFrom(dst, 32)}
	if err := l.PutPolicy(ctx, deny); err != nil {
		t.Fatal(err)
	}
	denied := func(when string) {
		t.Helper()
		for _, kind := range []string{"tcp4", "udp4"} {
			if _, err := eventually(converges, func() error {
				if roundTrips(l, "h1/c1", kind, to, 1) == nil {
					return errors.New("passes")
				}
				return nil
			}); err != nil {
				t.Errorf("%s %s: the deny rule does not hold", kind, when)
			}
		}
	}
	denied("with the rule")

	h, _ := l.Host("h1")
	sysctl := func(args ...string) string {
		out, err := exec.Command("ip", append([]string{"netns", "exec", h.Netns, "sysctl", "-n"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("sysctl %v: %v: %s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	sysctl("-w", "net.bridge.bridge-nf-call-iptables=0")
	// Any change of the store reconciles.
	if err := l.PutPolicy(ctx, policy.Rule{ID: "nudge", Priority: 9, Action: policy.Allow, Dst: netip.MustParsePrefix("192.0.2.0/24")}); err != nil {
		t.Fatal(err)
	}
	if _, err := eventually(converges, func() error {
		if v := sysctl("net.bridge.bridge-nf-call-iptables"); v != "1" {
			return errors.New("bridge-nf-call-iptables is " + v)
		}
		return nil
	}); err != nil {
		t.Errorf("after it was turned off and the agent reconciled: %v", err)
	}
	denied("after bridge-nf-call-iptables was turned off")
}
