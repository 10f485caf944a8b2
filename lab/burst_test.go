package lab

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

// TestAddBurst: 40 containers of one host attached at once (their ADDs in
// parallel, as a runtime starting many pods makes them, run side by side
// in the agent) get 40 different addresses and each reaches a container
// of the other host. Removed at once (their DELs in parallel), they leave the host as it was:
// the agent's endpoints, the cache's entries, the host's veths. How long
// the calls took is logged (p50, p99, max), not judged: timing belongs in
// benchmarks.
func TestAddBurst(t *testing.T) {
	l := newLab(t, Config{Name: "tburst", Hosts: 2, ContainersPerHost: 1, Mode: "auto"})
	ctx := context.Background()
	echoServer(t, l, "h2/c1", echoPort)
	dst, _ := l.IP("h2/c1")
	before := hostState(t, l, "h1")

	const n = 40
	names, took, err := l.AddContainers(ctx, "h1", n)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d ADDs at once: %s", n, spread(took))
	seen := map[netip.Addr]string{}
	for _, name := range names {
		ip, _ := l.IP(name)
		if other, dup := seen[ip]; dup {
			t.Errorf("%s and %s both got %s", other, name, ip)
		}
		seen[ip] = name
		if err := l.Do(name, func() error { return echoOnce(netip.AddrPortFrom(dst, echoPort)) }); err != nil {
			t.Errorf("%s (%s) → h2/c1: %v", name, ip, err)
		}
	}
	if got := hostState(t, l, "h1"); got.endpoints != before.endpoints+n || got.veths != before.veths+n || got.cache != before.cache+n {
		t.Errorf("after %d ADDs: %+v, want %d more of each than %+v", n, got, n, before)
	}

	took, err = l.RemoveContainers(ctx, names...)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d DELs at once: %s", n, spread(took))
	for msg, parts := range agentTimes(t, l) {
		for _, part := range []string{"took_ms", "wait_ms"} {
			ms := slices.Sorted(slices.Values(parts[part]))
			if len(ms) > 0 {
				t.Logf("skiffd %s %s: p50 %.1f ms, p99 %.1f ms", msg, strings.TrimSuffix(part, "_ms"), quantile(ms, 0.5), quantile(ms, 0.99))
			}
		}
	}
	if got := hostState(t, l, "h1"); got != before {
		t.Errorf("after the DELs: %+v, want %+v as before the burst", got, before)
	}
}

// burstState is what a burst of containers must leave as it found.
type burstState struct {
	endpoints, veths, cache int
}

// hostState counts host's endpoints (the agent's), its containers' veths
// and the cache's ingress entries.
func hostState(t *testing.T, l *Lab, host string) burstState {
	t.Helper()
	eps, err := agentOf(t, l, host).Endpoints(context.Background(), false)
	if err != nil {
		t.Fatal(err)
	}
	return burstState{endpoints: len(eps), veths: containerVeths(t, l, host), cache: len(cacheEntries(t, l, host).Ingress)}
}

// containerVeths counts the containers' veths (skf*) in host's namespace.
func containerVeths(t testing.TB, l *Lab, host string) int {
	t.Helper()
	n := 0
	if err := l.Do(host, func() error {
		links, err := netlink.LinkList()
		for _, link := range links {
			if strings.HasPrefix(link.Attrs().Name, "skf") && link.Type() == "veth" {
				n++
			}
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return n
}

// spread is p50, p99 and the longest of some durations, in ms.
func spread(ds []time.Duration) string {
	ms := make([]float64, len(ds))
	for i, d := range ds {
		ms[i] = float64(d.Microseconds()) / 1000
	}
	slices.Sort(ms)
	return fmt.Sprintf("p50 %.0f ms, p99 %.0f ms, max %.0f ms", quantile(ms, 0.5), quantile(ms, 0.99), ms[len(ms)-1])
}
