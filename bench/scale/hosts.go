package scale

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/lab"
	"github.com/skiffnet/skiff/store"
)

// HostsPoint is a lab of Hosts hosts, 2 pods each, all agents on this
// machine.
type HostsPoint struct {
	Hosts     int     `json:"hosts"`
	UpSeconds float64 `json:"upSeconds"` // the lab up, every agent ready
	// RSSMiB and IdleCPU are each agent's resident memory and the share
	// of one core it used over IdleSeconds with nothing changing.
	RSSMiB      Spread  `json:"rssMiB"`
	IdleCPU     Spread  `json:"idleCPUPercent"`
	IdleSeconds float64 `json:"idleSeconds"`
	// StoreKeys are the keys under /skiff/v1/; WritesPerAdd the store
	// revisions one pod's ADD made; ReconcilesPerAdd the reconciles every
	// agent together ran for it (less those of an idle stretch as long).
	StoreKeys        int64   `json:"storeKeys"`
	WritesPerAdd     int64   `json:"writesPerAdd"`
	ReconcilesPerAdd float64 `json:"reconcilesPerAdd"`
	// A new host joins: its agent's start until ready, its pod's ADD, and
	// from its agent being ready until each other host's pod connected
	// to its pod (Reach: one value per other host).
	JoinReadyMs float64 `json:"joinReadyMs"`
	JoinAddMs   float64 `json:"joinAddMs"`
	Reach       Spread  `json:"reach"`
}

const idle = 10 * time.Second

func runHosts(ctx context.Context, o Options) ([]HostsPoint, error) {
	var out []HostsPoint
	for _, n := range o.Hosts {
		p, err := hosts(ctx, o, n)
		if err != nil {
			return out, fmt.Errorf("%d hosts: %w", n, err)
		}
		o.logf("hosts %d: up %.0f s, RSS p50 %.0f MiB, idle CPU p50 %.2f %%, %d store writes and %.1f reconciles per ADD, new host reached by all in %.0f ms",
			n, p.UpSeconds, p.RSSMiB.P50, p.IdleCPU.P50, p.WritesPerAdd, p.ReconcilesPerAdd, p.Reach.Max)
		out = append(out, p)
	}
	return out, nil
}

func hosts(ctx context.Context, o Options, n int) (HostsPoint, error) {
	const name = "shosts"
	p := HostsPoint{Hosts: n}
	o.logf("hosts: lab %s (%d hosts, 2 pods each, auto)", name, n)
	start := time.Now()
	l, err := up(ctx, o, name, n, 2)
	if err != nil {
		return p, err
	}
	defer down(o, name)
	p.UpSeconds = time.Since(start).Seconds()

	// idle: nothing changes for a while, then CPU and memory over idle
	time.Sleep(5 * time.Second)
	before, err := procs(l)
	if err != nil {
		return p, err
	}
	recBefore, err := reconciles(ctx, l)
	if err != nil {
		return p, err
	}
	time.Sleep(idle)
	after, err := procs(l)
	if err != nil {
		return p, err
	}
	recIdle, err := reconciles(ctx, l)
	if err != nil {
		return p, err
	}
	p.IdleSeconds = idle.Seconds()
	var rss, cpu []float64
	for i := range after {
		rss = append(rss, after[i].rssMiB)
		cpu = append(cpu, 100*(after[i].cpu-before[i].cpu).Seconds()/idle.Seconds())
	}
	p.RSSMiB, p.IdleCPU = spreadOf(rss), spreadOf(cpu)

	// one ADD: what it writes to the store and makes every agent do
	keys, rev, err := storeCount(ctx, l)
	if err != nil {
		return p, err
	}
	p.StoreKeys = keys
	c, err := l.AddContainer(ctx, "h1")
	if err != nil {
		return p, err
	}
	_, rev2, err := storeCount(ctx, l)
	if err != nil {
		return p, err
	}
	p.WritesPerAdd = rev2 - rev
	recStart := time.Now()
	time.Sleep(2 * time.Second)
	recAfter, err := reconciles(ctx, l)
	if err != nil {
		return p, err
	}
	idleRate := float64(recIdle-recBefore) / idle.Seconds()
	p.ReconcilesPerAdd = float64(recAfter-recIdle) - idleRate*time.Since(recStart).Seconds()
	if err := l.RemoveContainer(ctx, c); err != nil {
		return p, err
	}

	// a new host joins
	start = time.Now()
	h, err := l.AddHost(ctx)
	if err != nil {
		return p, err
	}
	ready := time.Now()
	p.JoinReadyMs = millis(ready.Sub(start))
	c, err = l.AddContainer(ctx, h)
	if err != nil {
		return p, err
	}
	p.JoinAddMs = millis(time.Since(ready))
	ln, err := listen(l, c, probePort)
	if err != nil {
		return p, err
	}
	defer ln.Close()
	ip, err := l.IP(c)
	if err != nil {
		return p, err
	}
	var mu sync.Mutex
	var reached []float64
	var errs []error
	var wg sync.WaitGroup
	for _, other := range l.Hosts {
		if other.Name == h {
			continue
		}
		wg.Go(func() {
			d, err := reach(func(f func() error) error { return l.Do(other.Name+"/c1", f) }, netip.AddrPortFrom(ip, probePort), ready, 30*time.Second)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("from %s: %w", other.Name, err))
				return
			}
			reached = append(reached, millis(d))
		})
	}
	wg.Wait()
	p.Reach = spreadOf(reached)
	if len(errs) > 0 {
		return p, fmt.Errorf("new host %s: %v", h, errs)
	}
	return p, nil
}

// procs reads every agent's /proc entry.
func procs(l *lab.Lab) ([]proc, error) {
	out := make([]proc, len(l.Hosts))
	for i, h := range l.Hosts {
		var err error
		if out[i], err = readProc(h.AgentPID); err != nil {
			return nil, fmt.Errorf("agent of %s: %w", h.Name, err)
		}
	}
	return out, nil
}

// reconciles sums every agent's reconcile count.
func reconciles(ctx context.Context, l *lab.Lab) (uint64, error) {
	var n uint64
	for _, h := range l.Hosts {
		st, err := api.NewClient(h.Socket).Status(ctx)
		if err != nil {
			return 0, fmt.Errorf("status of %s: %w", h.Name, err)
		}
		n += st.Reconciles
	}
	return n, nil
}

// storeCount is how many keys skiff holds in the store, and its revision.
func storeCount(ctx context.Context, l *lab.Lab) (keys, rev int64, err error) {
	err = l.Admin(func(s *store.Store) error {
		resp, err := s.Client.Get(ctx, store.Prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return err
		}
		keys, rev = resp.Count, resp.Header.Revision
		return nil
	})
	return keys, rev, err
}
