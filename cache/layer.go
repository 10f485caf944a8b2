package cache

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/policy"
)

// The cache needs every host's endpoints: its egress caches name them all.
func init() {
	layer.Register(layer.Registration{Name: "cache", Needs: layer.Needs{Endpoints: true},
		Probe:    probe,
		New:      newLayer,
		Teardown: teardownLayer,
		Flags:    flags,
		Features: features,
		FullMTU:  func(o any) bool { return len(features(o)) > 0 },
	})
}

// Options are the cache layer's options (Capacity alone is taken too:
// the VXLAN tunnel).
type Options struct {
	Capacity Capacity
	Tunnel   string // TunnelVXLAN (""), or TunnelRewrite
}

// options reads the layer's options (nil: defaults).
func options(o any) (Options, error) {
	switch o := o.(type) {
	case nil:
		return Options{Capacity: DefaultCapacity}, nil
	case Capacity:
		return Options{Capacity: o}, nil
	case Options:
		if o.Tunnel != "" && o.Tunnel != TunnelVXLAN && o.Tunnel != TunnelRewrite {
			return Options{}, fmt.Errorf("cache tunnel %q: want %s or %s", o.Tunnel, TunnelVXLAN, TunnelRewrite)
		}
		return o, nil
	}
	return Options{}, fmt.Errorf("cache layer options are a cache.Options, not %T", o)
}

// features: a host whose cache rewrites announces it, so that its peers
// rewrite their packets to it and restore its.
func features(o any) []string {
	if opts, err := options(o); err == nil && opts.Tunnel == TunnelRewrite {
		return []string{FeatureRewrite}
	}
	return nil
}

// flags: --cache-capacity, --cache-connections, --cache-tunnel.
func flags(fs *flag.FlagSet) layer.FlagOptions {
	capacity := DefaultCapacity
	tunnel := fs.String("cache-tunnel", TunnelVXLAN, "cache layer: how fast-path packets cross between hosts: "+TunnelVXLAN+
		" (VXLAN headers), or "+TunnelRewrite+" (ONCache-t: the packet's own headers rewritten, between hosts that both rewrite; docs/cache.md)")
	fs.Func("cache-capacity", fmt.Sprintf("cache layer: sizes as egress-ips,egress-hosts,ingress,flows (default %d,%d,%d,%d)",
		capacity.EgressIPs, capacity.EgressHosts, capacity.Ingress, capacity.Filter), func(v string) error {
		_, err := fmt.Sscanf(v, "%d,%d,%d,%d", &capacity.EgressIPs, &capacity.EgressHosts, &capacity.Ingress, &capacity.Filter)
		return err
	})
	fs.Func("cache-connections", fmt.Sprintf("cache layer: TCP connections the fast path carries from their first packet; "+
		"more take the overlay (default %d)", capacity.Connections), func(v string) error {
		_, err := fmt.Sscanf(v, "%d", &capacity.Connections)
		return err
	})
	return func(layer.Settings) (any, error) {
		o := Options{Capacity: capacity, Tunnel: *tunnel}
		_, err := options(o)
		return o, err
	}
}

// Layer is the cache as the agent drives it (package layer).
type Layer struct {
	capacity Capacity
	tunnel   string
	c        *fastPath
	// state is the view the caches were last made coherent with (nil:
	// never); reconciles that find it unchanged leave the caches alone.
	state *layer.View
	// pending: Sync found a new view, Settle makes the caches coherent
	// with it; pause: Sync paused learning, Settle resumes it.
	pending, pause bool
	eps            layer.Attached // local containers on the fast path
	stop           func()         // ends maintain (expiry, header refresh)
	// The policy the first-packet judge was compiled for: a container
	// added between reconciles is judged from its ADD.
	judged struct {
		sync.Mutex
		rules policy.Set
		known bool // rules came from a reconcile (before: no verdicts at all)
	}
}

// judge compiles the first-packet policy for a reconcile's rules and
// local containers.
func (l *Layer) judge(rules policy.Set, local []cluster.Endpoint) error {
	j := &l.judged
	j.Lock()
	defer j.Unlock()
	j.rules, j.known = rules, true
	addrs := make([]netip.Addr, 0, len(local))
	for _, e := range local {
		addrs = append(addrs, e.IP.Addr())
	}
	return l.c.SyncPolicy(rules, addrs)
}

// judgeAlso compiles the last reconcile's rules for a container added
// since (its share only), or forgets a removed one's.
func (l *Layer) judgeAlso(a netip.Addr, added bool) error {
	j := &l.judged
	j.Lock()
	defer j.Unlock()
	if !j.known {
		return nil // no rules yet: the first reconcile compiles for every container
	}
	if !added {
		return l.c.policy.Remove(a)
	}
	return l.c.AddPolicy(j.rules, a)
}

// probe checks what the fast path needs beyond the overlay (whose source
// check already needs tc eBPF programs): redirecting into a namespace,
// resizing a packet's headroom, and connection tracking for the mark rule.
func probe(any) error {
	return layer.First(
		layer.Programs(ebpf.SchedCLS, asm.FnRedirectPeer, asm.FnSkbAdjustRoom, asm.FnCsumDiff),
		layer.Maps(ebpf.LRUHash, ebpf.PerCPUArray),
		conntrack,
	)
}

// conntrack checks for the connection tracking the mark rule reads.
func conntrack() error {
	if _, err := os.Stat(liberal); err != nil {
		return fmt.Errorf("no connection tracking (nf_conntrack): %w", err)
	}
	return nil
}

// newLayer takes Options, or a Capacity (nil: defaults).
func newLayer(o any) (layer.Layer, error) {
	opts, err := options(o)
	if err != nil {
		return nil, err
	}
	return &Layer{capacity: opts.Capacity, tunnel: opts.Tunnel}, nil
}

// Start loads the fast path (reusing pinned maps from an earlier run) and
// attaches it to the underlay.
func (l *Layer) Start(ctx context.Context, env layer.Env) error {
	c, err := load(config{Cluster: env.Cluster, Host: env.Host, Underlay: env.Underlay,
		PinDir: env.PinDir, Capacity: l.capacity, Tunnel: l.tunnel}, env.Log)
	if err != nil {
		return err
	}
	if err := c.Setup(); err != nil {
		c.Close()
		return fmt.Errorf("set up cache: %w", err)
	}
	l.c = c
	expiry, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.maintain(expiry, 10*time.Second)
	}()
	l.stop = func() { cancel(); <-done }
	env.Log.Info("cache fast path attached", "pins", env.PinDir)
	return nil
}

// teardownLayer removes a fast path an earlier run left behind, so a host
// switched to another mode carries nothing on stale caches.
func teardownLayer(env layer.Env, _ any) (bool, error) {
	if !pinned(env.PinDir) {
		return false, nil
	}
	if err := teardown(config{Cluster: env.Cluster, PinDir: env.PinDir}); err != nil {
		return true, fmt.Errorf("remove the cache fast path: %w", err)
	}
	return true, nil
}

// AddEndpoint attaches the fast path to a container; a failure is the
// container's (it keeps the overlay), tried again at every Settle.
func (l *Layer) AddEndpoint(_ context.Context, e cluster.Endpoint) error {
	if err := l.eps.Add(e, l.c.AddEndpoint); err != nil {
		return err
	}
	return l.judgeAlso(e.IP.Addr(), true)
}

// RemoveEndpoint runs before the address is released: nothing may reach a
// future holder of the address through entries learned for this one.
func (l *Layer) RemoveEndpoint(_ context.Context, e cluster.Endpoint) error {
	l.eps.Remove(e)
	return errors.Join(l.c.RemoveEndpoint(e),
		l.judgeAlso(e.IP.Addr(), false))
}

// Endpoint says whether a local container's cross-host flows can take the
// fast path.
func (l *Layer) Endpoint(e cluster.Endpoint) (bool, string) {
	if err := l.eps.Err(e); err != nil {
		return false, err.Error()
	}
	return true, ""
}

// Sync and Settle apply a cluster change with delete-and-reinitialize
// (ONCache §3.4). Learning pauses while a policy or host change is applied
// and stale entries go, so that a packet marked under the old state cannot
// teach the new one: Sync pauses before the overlay applies the policy (a
// failure holds the policy back), Settle purges and resumes. Endpoint churn
// needs no pause (entries of deleted endpoints are purged either way, and
// nothing marks a packet for a flow to an address the overlay no longer
// delivers), so frequent container starts and stops never hold learning up.
func (l *Layer) Sync(_ context.Context, v *layer.View) error {
	l.pending = !v.Same(l.state)
	l.pause = l.pending && (v.PolicyChanged || l.state == nil || !slices.EqualFunc(v.Hosts, l.state.Hosts, cluster.Host.Equal))
	if l.pause {
		if err := l.c.SetPaused(true); err != nil {
			l.pending, l.pause = false, false
			return fmt.Errorf("%w: %w", layer.ErrHoldPolicy, err)
		}
	}
	return nil
}

func (l *Layer) Settle(_ context.Context, v *layer.View) error {
	err := l.settle(v)
	// Containers there before the agent started are attached here, once;
	// later ones by AddEndpoint; failed ones again at every Settle.
	l.eps.Sync(v.Local, l.c.AddEndpoint, l.c.log)
	return err
}

func (l *Layer) settle(v *layer.View) error {
	if !l.pending {
		return nil
	}
	var errs []error
	// The first packets' judge first: no SYN opens a connection under the
	// old policy once the purge ran.
	errs = append(errs, l.judge(v.Rules, v.Local))
	if v.PolicyChanged {
		n, err := l.c.PurgeDenied(v.Rules)
		if n > 0 {
			l.c.log.Info("purged cached flows the policy denies", "flows", n)
		}
		errs = append(errs, err)
	}
	errs = append(errs, l.c.Sync(v.Endpoints, v.Hosts), l.c.setVXLAN())
	if l.pause {
		// A packet marked established under the old state and still queued
		// must not teach the cache after the purge.
		time.Sleep(5 * time.Millisecond)
		errs = append(errs, l.c.SetPaused(false))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	l.state = v // nothing to purge until it changes
	return nil
}

// Status reports the programs' counters (program/outcome).
func (l *Layer) Status([]cluster.Endpoint) layer.Report {
	stats, _ := l.c.Stats()
	conns, _ := l.c.Connections()
	return report(stats, conns, l.c.cfg.Capacity.Connections)
}

// Inspect adds every cache entry to the status (skiff layer cache).
func (l *Layer) Inspect() (layer.Report, error) {
	stats, err := l.c.Stats()
	if err != nil {
		return layer.Report{}, err
	}
	e, err := l.c.Entries()
	if err != nil {
		return layer.Report{}, err
	}
	conns, err := l.c.Connections()
	if err != nil {
		return layer.Report{}, err
	}
	r := report(stats, conns, l.c.cfg.Capacity.Connections)
	for _, n := range conns {
		e.Connections += n
	}
	e.ConnectionCapacity = l.c.cfg.Capacity.Connections
	r.Details = e
	r.View = append(r.View, e.view()...)
	return r, nil
}

func (l *Layer) Close() error {
	if l.stop != nil {
		l.stop()
	}
	return l.c.Close()
}
