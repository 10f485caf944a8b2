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

	"github.com/skiffnet/skiff/lab/labtest"
)

// iperfRate runs iperf3 from the namespace ns against server for 4 s
// (reverse: the server sends) and returns the receiver's bit/s.
func iperfRate(t *testing.T, ns, server string, reverse bool) float64 {
	t.Helper()
	args := []string{"netns", "exec", ns, "iperf3", "-4", "-J", "-c", server, "-p", "5400", "-t", "4", "-O", "1"}
	if reverse {
		args = append(args, "-R")
	}
	out, err := exec.Command("ip", args...).Output()
	if err != nil {
		t.Fatalf("iperf3 from %s: %v\n%s", ns, err, out)
	}
	var r struct {
		End struct {
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
	}
	if err := json.Unmarshal(out, &r); err != nil || r.End.SumReceived.BitsPerSecond == 0 {
		t.Fatalf("iperf3 from %s: %v\n%s", ns, err, out)
	}
	return r.End.SumReceived.BitsPerSecond
}

// TestRateLimits: a container's CNI bandwidth limit holds in both
// directions with every layer on (auto): egress is shaped on its own
// interface, ingress on its host veth, which the cache's fast path now
// delivers through for a limited container; such a container gets no host
// sockets (they would skip the veth). Goodput within 10 % of the limit.
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
	for _, e := range eps {
		if e.ContainerID == ns {
			if on, why := paths(e); on != "cache" || why == "" {
				t.Errorf("limited container: layers %q (%s), want the cache and why not sockets", on, why)
			}
		}
	}
	free := iperfRate(t, h1c1, server.String(), false)
	before := cacheStats(t, l, "h1")
	for _, c := range []struct {
		name    string
		reverse bool
		limit   float64
	}{{"egress", false, egress}, {"ingress", true, ingress}} {
		got := iperfRate(t, ns, server.String(), c.reverse)
		t.Logf("%s: %.1f Mbit/s with a %.0f Mbit/s limit (an unlimited neighbour: %.0f Mbit/s)", c.name, got/1e6, c.limit/1e6, free/1e6)
		if got < 0.9*c.limit || got > 1.1*c.limit {
			t.Errorf("%s goodput %.1f Mbit/s, want %.0f ±10 %%", c.name, got/1e6, c.limit/1e6)
		}
	}
	if after := cacheStats(t, l, "h1"); after["from_underlay/hit"] == before["from_underlay/hit"] {
		t.Error("the limited container's ingress never took the cache's fast path: the test shows nothing of it")
	}
	if free < 3*ingress {
		t.Errorf("an unlimited container sends %.0f Mbit/s: too slow for the test to tell a limit", free/1e6)
	}
	limitChangesLive(t, l, ns, server.String(), egress)
}

// limitChangesLive: skiff limit set changes a running container's limit
// in the middle of a transfer — in force within a second, the connection
// kept — and bad input changes nothing; skiff limit del gives the
// runtime's limit back.
func limitChangesLive(t *testing.T, l *Lab, ns, server string, runtime float64) {
	skiff := filepath.Join(labtest.BinDir(t, "skiff"), "skiff")
	cli := func(args ...string) (string, error) {
		out, err := exec.Command(skiff, append([]string{"limit"}, args...)...).CombinedOutput()
		return string(out), err
	}
	if out, err := cli("set", ns, "--egress", "5tbit"); err == nil || !strings.Contains(out, "above 1tbit") {
		t.Errorf("skiff limit set --egress 5tbit: %v\n%s", err, out)
	}
	if out, err := cli("list"); err != nil || !strings.Contains(out, ns) || !strings.Contains(out, "50mbit") || !strings.Contains(out, "runtime") {
		t.Errorf("skiff limit list after bad input: %v\n%s", err, out)
	}
	const changed, at = 20e6, 3.0 // bit/s, seconds into the transfer
	cmd := exec.Command("ip", "netns", "exec", ns, "iperf3", "-4", "-J", "-c", server, "-p", "5400", "-t", "7", "-i", "0.2")
	var out bytes.Buffer
	cmd.Stdout = &out
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Duration(at * float64(time.Second)))
	set := time.Since(start).Seconds()
	if out, err := cli("set", ns, "--egress", "20mbit"); err != nil {
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
	t.Logf("live change at %.1f s: %.1f Mbit/s before (limit %.0f), %.1f Mbit/s from a second after (limit %.0f)", set, before/1e6, runtime/1e6, after/1e6, changed/1e6)
	if after < 0.9*changed || after > 1.1*changed || before < 0.9*runtime {
		t.Errorf("rate %.1f Mbit/s before and %.1f after the change to %.0f Mbit/s", before/1e6, after/1e6, changed/1e6)
	}
	if out, err := cli("list"); err != nil || !strings.Contains(out, "20mbit") || !strings.Contains(out, "skiff limit") {
		t.Errorf("skiff limit list: %v\n%s", err, out)
	}
	if out, err := cli("del", ns); err != nil {
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
}
