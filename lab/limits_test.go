package lab

import (
	"bytes"
	"context"
	"encoding/json"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/lab/labtest"
)

// iperfRate runs iperf3 from the namespace ns against server for 4 s
// (reverse: the server sends) and returns the receiver's bit/s.
func iperfRate(t *testing.T, ns, server string, reverse bool) float64 {
	t.Helper()
	return iperfRun(t, exec.Command("ip", append([]string{"netns", "exec", ns}, iperfArgs(server, reverse)...)...))
}

// iperfArgs is an iperf3 client's command line: 4 s (after 1 s left out)
// against server's port 5400, the server sending with reverse, then extra.
func iperfArgs(server string, reverse bool, extra ...string) []string {
	args := []string{"iperf3", "-4", "-J", "-c", server, "-p", "5400", "-t", "4", "-O", "1"}
	if reverse {
		args = append(args, "-R")
	}
	return append(args, extra...)
}

// liveArgs is the iperf3 client limitChangesLive watches: 7 s in 0.2 s
// intervals.
func liveArgs(server string) []string {
	return []string{"iperf3", "-4", "-J", "-c", server, "-p", "5400", "-t", "7", "-i", "0.2"}
}

// iperfRun runs an iperf3 client and returns the receiver's bit/s.
func iperfRun(t *testing.T, cmd *exec.Cmd) float64 {
	t.Helper()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: %v\n%s", cmd, err, out)
	}
	var r struct {
		End struct {
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
	}
	if err := json.Unmarshal(out, &r); err != nil || r.End.SumReceived.BitsPerSecond == 0 {
		t.Fatalf("%s: %v\n%s", cmd, err, out)
	}
	return r.End.SumReceived.BitsPerSecond
}

// TestRateLimits: a container's CNI bandwidth limit holds in both
// directions with every layer on (auto): egress is shaped on its own
// interface, ingress on its host veth, which the cache's fast path now
// delivers through for a limited container; skiff limit changes it while
// a transfer runs; on a container with host sockets, which skip the veth,
// the cgroup's buckets and pacing hold it. Goodput within 10 % of the
// limit.
func TestRateLimits(t *testing.T) {
	l := newLab(t, Config{Name: "tlimit", Hosts: 2, ContainersPerHost: 1, Mode: "auto"})
	ctx := context.Background()
	cc, list, err := l.cni("h1")
	if err != nil {
		t.Fatal(err)
	}
	const egress, ingress = 50e6, 80e6
	_, rc, err := runtimeAdd(t, cc, list, l, "lim", "eth0", map[string]any{
		"bandwidth": map[string]any{"egressRate": egress, "egressBurst": 1e6, "ingressRate": ingress, "ingressBurst": 1e6}}, nil)
	if err != nil {
		t.Fatalf("ADD with a bandwidth limit: %v", err)
	}
	ns := rc.ContainerID
	server, _ := l.IP("h2/c1")
	srv, err := l.Command(ctx, "h2/c1", "iperf3", "-4", "-s", "-p", "5400")
	if err != nil {
		t.Fatal(err)
	}
	p := startProc(t, srv, false)
	waitListener(t, l, "h2", netip.AddrPortFrom(server, 5400), p.exited)
	// The unlimited neighbour's rate, for scale.
	h1c1, _ := l.Netns("h1/c1")
	eps, err := agentOf(t, l, "h1").Endpoints(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	found := 0
	for _, e := range eps {
		if e.ContainerID == ns {
			found++
			if on, why := paths(e); on != "cache" || why == "" {
				t.Errorf("limited container: layers %q (%s), want the cache and why not sockets", on, why)
			}
		}
	}
	if found != 1 {
		t.Errorf("the limited container is listed %d times, want once", found)
	}
	free := iperfRate(t, h1c1, server.String(), false)
	for _, c := range []struct {
		name    string
		reverse bool
		limit   float64
	}{{"egress", false, egress}, {"ingress", true, ingress}} {
		before := cacheStats(t, l, "h1")
		got := iperfRate(t, ns, server.String(), c.reverse)
		t.Logf("%s: %.1f Mbit/s with a %.0f Mbit/s limit (an unlimited neighbour: %.0f Mbit/s)", c.name, got/1e6, c.limit/1e6, free/1e6)
		if got < 0.9*c.limit || got > 1.1*c.limit {
			t.Errorf("%s goodput %.1f Mbit/s, want %.0f ±10 %%", c.name, got/1e6, c.limit/1e6)
		}
		// The data of the ingress run took the cache's fast path, through
		// the host veth's qdisc.
		if hits := cacheStats(t, l, "h1")["from_underlay/hit_shaped"] - before["from_underlay/hit_shaped"]; c.reverse && hits < 1000 {
			t.Errorf("the limited container's ingress took the cache's shaped fast path %d times: the test shows nothing of it", hits)
		}
	}
	if free < 3*ingress {
		t.Errorf("an unlimited container sends %.0f Mbit/s: too slow for the test to tell a limit", free/1e6)
	}
	skiff := skiffLimit(t)
	if out, err := skiff("set", ns, "--egress", "5tbit"); err == nil || !strings.Contains(out, "above 1tbit") {
		t.Errorf("skiff limit set --egress 5tbit: %v\n%s", err, out)
	}
	if out, err := skiff("list"); err != nil || !strings.Contains(out, ns) || !strings.Contains(out, "50mbit") || !strings.Contains(out, "runtime") {
		t.Errorf("skiff limit list after bad input: %v\n%s", err, out)
	}
	limitChangesLive(t, ns, egress, 20e6, exec.Command("ip", append([]string{"netns", "exec", ns}, liveArgs(server.String())...)...))
	if out, err := skiff("list"); err != nil || !strings.Contains(out, "20mbit") || !strings.Contains(out, "skiff limit") {
		t.Errorf("skiff limit list: %v\n%s", err, out)
	}
	if out, err := skiff("del", ns); err != nil {
		t.Errorf("skiff limit del: %v\n%s", err, out)
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		q, _ := exec.Command("ip", "netns", "exec", ns, "tc", "class", "show", "dev", "eth0").CombinedOutput()
		if strings.Contains(string(q), "rate 50Mbit") {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("the runtime's limit is not back 2 s after skiff limit del:\n%s", q)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	hostSocketLimits(t, l, server.String())
	udpAndNeighbours(t, l, ns, server.String(), free)
}

// udpAndNeighbours: a UDP flood keeps to its sender's limit, a 1 Gbit/s
// limit holds as a 100 Mbit/s one does, and a UDP flood from one limited
// container beside a TCP flow from another leaves each its own limit.
func udpAndNeighbours(t *testing.T, l *Lab, ns, server string, free float64) {
	ctx := context.Background()
	skiff := skiffLimit(t)
	c1 := l.prefix() + "h1-c1"
	for id, args := range map[string][]string{ns: {"--egress", "100mbit", "--ingress", "1gbit"}, c1: {"--egress", "50mbit"}} {
		if out, err := skiff(append([]string{"set", id}, args...)...); err != nil {
			t.Fatalf("skiff limit set: %v\n%s", err, out)
		}
	}
	srv, err := l.Command(ctx, "h2/c1", "iperf3", "-4", "-s", "-p", "5401")
	if err != nil {
		t.Fatal(err)
	}
	p := startProc(t, srv, false)
	addr, _ := netip.ParseAddr(server)
	waitListener(t, l, "h2", netip.AddrPortFrom(addr, 5401), p.exited)
	time.Sleep(time.Second) // the agents apply the limits
	flood := func() *exec.Cmd {
		return exec.Command("ip", append([]string{"netns", "exec", ns}, iperfArgs(server, false, "-u", "-b", "300M", "-l", "1400")...)...)
	}
	within := func(name string, got, limit float64) {
		t.Helper()
		t.Logf("%s: %.1f Mbit/s with a %.0f Mbit/s limit", name, got/1e6, limit/1e6)
		if got < 0.9*limit || got > 1.1*limit {
			t.Errorf("%s: goodput %.1f Mbit/s, want %.0f ±10 %%", name, got/1e6, limit/1e6)
		}
	}
	within("UDP flood, egress", iperfRun(t, flood()), 100e6)
	if free < 3e9 {
		t.Errorf("an unlimited container sends %.0f Mbit/s: too slow to tell a 1 Gbit/s limit", free/1e6)
	}
	within("TCP ingress", iperfRate(t, ns, server, true), 1e9)
	// Together: the flood from one container, a TCP flow from the other.
	args := iperfArgs(server, false)
	args[6] = "5401" // -p
	tcp, err := l.Command(ctx, "h1/c1", args[0], args[1:]...)
	if err != nil {
		t.Fatal(err)
	}
	rates := make(chan float64, 1)
	go func() { rates <- iperfRun(t, flood()) }()
	within("TCP beside a UDP flood", iperfRun(t, tcp), 50e6)
	within("UDP flood beside a TCP flow", <-rates, 100e6)
	skiff("del", c1)

	// 10 Mbit/s both ways, to a container of the same host.
	if out, err := skiff("set", ns, "--egress", "10mbit", "--ingress", "10mbit"); err != nil {
		t.Fatalf("skiff limit set: %v\n%s", err, out)
	}
	near, err := l.Command(ctx, "h1/c1", "iperf3", "-4", "-s", "-p", "5402")
	if err != nil {
		t.Fatal(err)
	}
	np := startProc(t, near, false)
	nearIP, _ := l.IP("h1/c1")
	waitListener(t, l, "h1", netip.AddrPortFrom(nearIP, 5402), np.exited)
	time.Sleep(time.Second)
	for _, reverse := range []bool{false, true} {
		args := iperfArgs(nearIP.String(), reverse)
		args[6] = "5402" // -p
		within(map[bool]string{false: "same host, egress", true: "same host, ingress"}[reverse],
			iperfRun(t, exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...)), 10e6)
	}
	skiff("del", ns)
}

// skiffLimit runs skiff limit (on the lab's store and first agent).
func skiffLimit(t *testing.T) func(args ...string) (string, error) {
	skiff := filepath.Join(labtest.BinDir(t, "skiff"), "skiff")
	return func(args ...string) (string, error) {
		out, err := exec.Command(skiff, append([]string{"limit"}, args...)...).CombinedOutput()
		return string(out), err
	}
}

// hostSocketLimits: a limit set on a container with host sockets (the
// sockets layer: they skip its veth and qdiscs) holds on them — egress
// over four connections together, ingress, and a change in the middle of
// a connection.
func hostSocketLimits(t *testing.T, l *Lab, server string) {
	ctx := context.Background()
	const rate = 100e6
	id := l.prefix() + "h1-c1"
	skiff := skiffLimit(t)
	if out, err := skiff("set", id, "--egress", "100mbit", "--ingress", "100mbit"); err != nil {
		t.Fatalf("skiff limit set: %v\n%s", err, out)
	}
	time.Sleep(time.Second)
	before := socketsStatus(t, l, "h1").Counters
	for _, c := range []struct {
		name    string
		reverse bool
		extra   []string
	}{{"egress, 4 connections", false, []string{"-P", "4"}}, {"ingress", true, nil}} {
		args := iperfArgs(server, c.reverse, c.extra...)
		cmd, err := l.Command(ctx, "h1/c1", args[0], args[1:]...)
		if err != nil {
			t.Fatal(err)
		}
		got := iperfRun(t, cmd)
		t.Logf("host sockets, %s: %.1f Mbit/s with a %.0f Mbit/s limit", c.name, got/1e6, rate/1e6)
		if got < 0.9*rate || got > 1.1*rate {
			t.Errorf("host sockets, %s: goodput %.1f Mbit/s, want %.0f ±10 %%", c.name, got/1e6, rate/1e6)
		}
	}
	after := socketsStatus(t, l, "h1").Counters
	delta := func(name string) uint64 { return after[name] - before[name] }
	t.Logf("host sockets: %d fast connects, %d paced, %d packets shaped through the IFB, %d egress segments held",
		delta("connect_fast"), delta("limit_paced"), delta("limit_shaped"), delta("limit_egress_held"))
	if delta("connect_fast") < 5 || delta("limit_paced") < 5 || delta("limit_shaped") < 1000 {
		t.Error("the transfers did not take host sockets, or their limits did not act: the test shows nothing of them")
	}
	args := liveArgs(server)
	cmd, err := l.Command(ctx, "h1/c1", args[0], args[1:]...)
	if err != nil {
		t.Fatal(err)
	}
	limitChangesLive(t, id, rate, 30e6, cmd)
	if out, err := skiff("del", id); err != nil {
		t.Errorf("skiff limit del: %v\n%s", err, out)
	}
	// No ingress class left: the classifier (a socket lookup per TCP
	// packet) leaves the devices.
	filters := func() string {
		c, err := l.Command(ctx, "h1", "tc", "filter", "show", "dev", "lo", "ingress")
		if err != nil {
			t.Fatal(err)
		}
		out, err := c.CombinedOutput()
		if err != nil {
			t.Fatalf("tc filter show: %v: %s", err, out)
		}
		return string(out)
	}
	for deadline := time.Now().Add(3 * time.Second); strings.Contains(filters(), "skiff-limits"); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Errorf("skl_classify still on lo after the last ingress limit went:\n%s", filters())
			break
		}
	}
}

// limitChangesLive: skiff limit set changes a running container's egress
// limit from was to to in the middle of a transfer (cmd: an iperf3 client
// of 7 s with 0.2 s intervals) — in force within a second, the connection
// kept.
func limitChangesLive(t *testing.T, id string, was, to float64, cmd *exec.Cmd) {
	t.Helper()
	const at = 3.0 // seconds into the transfer
	var out bytes.Buffer
	cmd.Stdout = &out
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Duration(at * float64(time.Second)))
	set := time.Since(start).Seconds()
	if out, err := skiffLimit(t)("set", id, "--egress", cluster.FormatRate(uint64(to))); err != nil {
		t.Errorf("skiff limit set: %v\n%s", err, out)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the transfer did not survive the change: %v\n%s", err, out.String())
	}
	var r struct {
		Intervals []struct {
			Sum struct {
				Start, End    float64
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum"`
		} `json:"intervals"`
	}
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	var before, after, nb, na float64
	for _, iv := range r.Intervals {
		switch {
		case iv.Sum.Start >= 1 && iv.Sum.End <= set:
			before, nb = before+iv.Sum.BitsPerSecond, nb+1
		case iv.Sum.Start >= set+1:
			after, na = after+iv.Sum.BitsPerSecond, na+1
		}
	}
	if nb == 0 || na == 0 {
		t.Fatalf("intervals before/after the change: %v/%v\n%s", nb, na, out.String())
	}
	before, after = before/nb, after/na
	t.Logf("live change at %.1f s: %.1f Mbit/s before (limit %.0f), %.1f Mbit/s from a second after (limit %.0f)", set, before/1e6, was/1e6, after/1e6, to/1e6)
	// What a limit promises: never above it (5 % for the intervals'
	// edges), and at it — goodput is about 0.95 of the rate before
	// headers, 0.89 seen once on a busy machine — from a second after the
	// change.
	if after < 0.85*to || after > 1.05*to || before < 0.85*was || before > 1.05*was {
		t.Errorf("rate %.1f Mbit/s before the change (limit %.0f) and %.1f after (limit %.0f)", before/1e6, was/1e6, after/1e6, to/1e6)
	}
}

// TestRateLimitsPerLayer: a container's limit holds with each layer alone
// as it does with all of them: the overlay and the cache on the
// container's own sockets (a runtime's CNI limit), the sockets layer on
// its host sockets (a limit set with skiff limit).
func TestRateLimitsPerLayer(t *testing.T) {
	const rate = 40e6
	for _, mode := range []string{"overlay", "cache", "sockets"} {
		t.Run(mode, func(t *testing.T) {
			l := newLab(t, Config{Name: "tlim" + mode[:2], Hosts: 2, ContainersPerHost: 1, Mode: mode})
			ctx := context.Background()
			server, _ := l.IP("h2/c1")
			srv, err := l.Command(ctx, "h2/c1", "iperf3", "-4", "-s", "-p", "5400")
			if err != nil {
				t.Fatal(err)
			}
			p := startProc(t, srv, false)
			if mode == "sockets" {
				waitListener(t, l, "h2", netip.AddrPortFrom(server, 5400), p.exited)
			} else {
				time.Sleep(500 * time.Millisecond)
			}
			client := func(reverse bool) *exec.Cmd {
				args := iperfArgs(server.String(), reverse)
				cmd, err := l.Command(ctx, "h1/c1", args[0], args[1:]...)
				if err != nil {
					t.Fatal(err)
				}
				return cmd
			}
			if mode == "sockets" {
				if out, err := skiffLimit(t)("set", l.prefix()+"h1-c1", "--egress", "40mbit", "--ingress", "40mbit"); err != nil {
					t.Fatalf("skiff limit set: %v\n%s", err, out)
				}
				time.Sleep(time.Second)
			} else {
				cc, list, err := l.cni("h1")
				if err != nil {
					t.Fatal(err)
				}
				_, rc, err := runtimeAdd(t, cc, list, l, "lim", "eth0", map[string]any{
					"bandwidth": map[string]any{"egressRate": rate, "egressBurst": 1e6, "ingressRate": rate, "ingressBurst": 1e6}}, nil)
				if err != nil {
					t.Fatalf("ADD with a bandwidth limit: %v", err)
				}
				client = func(reverse bool) *exec.Cmd {
					return exec.Command("ip", append([]string{"netns", "exec", rc.ContainerID}, iperfArgs(server.String(), reverse)...)...)
				}
			}
			for _, reverse := range []bool{false, true} {
				var before map[string]uint64
				if mode == "cache" {
					before = cacheStats(t, l, "h1")
				}
				got := iperfRun(t, client(reverse))
				name := map[bool]string{false: "egress", true: "ingress"}[reverse]
				if mode == "cache" && reverse {
					if n := cacheStats(t, l, "h1")["from_underlay/hit_shaped"] - before["from_underlay/hit_shaped"]; n < 1000 {
						t.Errorf("cache, ingress: %d shaped hits, the fast path not shown", n)
					}
				}
				t.Logf("%s, %s: %.1f Mbit/s with a %.0f Mbit/s limit", mode, name, got/1e6, rate/1e6)
				if got < 0.9*rate || got > 1.1*rate {
					t.Errorf("%s, %s: goodput %.1f Mbit/s, want %.0f ±10 %%", mode, name, got/1e6, rate/1e6)
				}
			}
			if mode == "sockets" {
				if n := socketsStatus(t, l, "h1").Counters["connect_fast"]; n < 2 {
					t.Errorf("%d connections on host sockets: the test shows nothing of them", n)
				}
			}
		})
	}
}
