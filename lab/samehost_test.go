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
// host (UDP and TCP), for broadcast and multicast too (the receiver it
// denies gets none, another still gets them), also after someone turned
// off the sysctl that passes bridged packets through iptables: the agent
// sets it again at its next reconcile and says so. Before, skiff neither
// set nor checked it, and with it off same-host deny rules did nothing;
// broadcast and multicast passed a deny rule naming the receiver.
func TestSameHostPolicy(t *testing.T) {
	l := newLab(t, Config{Name: "tsamepol", Hosts: 1, ContainersPerHost: 3, Mode: "overlay"})
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
	broadcastJudged(t, l)

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

// pyBcastListen counts, for argv[1] seconds, the datagrams on port
// argv[2] by their first word, and prints "got KIND=N ...".
const pyBcastListen = `
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[2])))
s.settimeout(0.2)
print("ready", flush=True)
got, end = {}, time.time() + float(sys.argv[1])
while time.time() < end:
    try:
        k = s.recv(100).split()[0].decode()
        got[k] = got.get(k, 0) + 1
    except socket.timeout:
        pass
print("got " + " ".join("%s=%d" % kv for kv in sorted(got.items())), flush=True)
`

// pyBcastSend sends 5 datagrams to port argv[1] at each address after it,
// each carrying its address's name.
const pyBcastSend = `
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
for _ in range(5):
    for a in sys.argv[2:]:
        s.sendto(a.encode() + b" x", (a, int(sys.argv[1])))
    time.sleep(0.05)
`

// broadcastJudged: with h1/c1 denied to h1/c2, h1/c1's subnet broadcast,
// limited broadcast and all-hosts multicast reach h1/c3 and not h1/c2.
func broadcastJudged(t *testing.T, l *Lab) {
	t.Helper()
	const port = "7500"
	src, _ := l.IP("h1/c1")
	sub, _ := src.Prefix(24)
	b := sub.Addr().As4()
	b[3] = 255
	bcast := netip.AddrFrom4(b).String()
	var listeners []*proc
	for _, c := range []string{"h1/c2", "h1/c3"} {
		p := startPy(t, l, c, pyBcastListen, nil, "3", port)
		if got := p.line(t, 10*time.Second); got != "ready" {
			t.Fatalf("%s: %q", c, got)
		}
		listeners = append(listeners, p)
	}
	if out := runPyErr(l, "h1/c1", pyBcastSend, port, bcast, "255.255.255.255", "224.0.0.1"); strings.TrimSpace(out) != "" {
		t.Fatalf("sender: %s", out)
	}
	denied, other := listeners[0].line(t, 10*time.Second), listeners[1].line(t, 10*time.Second)
	t.Logf("denied receiver %q, other receiver %q", denied, other)
	if strings.TrimSpace(denied) != "got" {
		t.Errorf("the denied receiver got %q, want nothing", denied)
	}
	for _, a := range []string{bcast, "255.255.255.255", "224.0.0.1"} {
		if !strings.Contains(other, a+"=") {
			t.Errorf("the other receiver got no %s: %q", a, other)
		}
	}
}
