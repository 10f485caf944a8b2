// Package agent is skiffd: one per host, it joins the cluster, owns the
// host's data plane and converges it to the cluster store. Kernel state
// (links, routes, neighbours, iptables chains) outlives the process, so the
// agent can restart — or lose the store — without dropping traffic.
package agent

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/cni"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/source"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/timing"
)

// Modes the agent can run the data plane in: auto, overlay, and each of
// the layers it links.
func Modes() []string { return layer.Modes() }

// Config is what skiffd is started with.
type Config struct {
	Name          string // host name in the cluster
	Underlay      string // interface carrying the underlay address
	EtcdEndpoints []string
	EtcdTLS       store.TLS // how the store is reached
	Socket        string    // API socket path
	StateDir      string    // local cache of the host's cluster identity
	Cluster       cluster.Config
	// Mode (Modes; default auto) or Layers (non-nil) say which
	// layers run (layer.Choose).
	Mode   string
	Layers []string
	BPFDir string // bpffs directory for pinned maps and links
	// UnderlayRate shapes the underlay for QoS classes (bit/s; 0: not).
	UnderlayRate uint64
	// LayerOptions are each layer's options, by layer name (nil: the
	// layer's defaults; the type is the layer package's, e.g.
	// cache.Capacity, sockets.Options).
	LayerOptions map[string]any
	ResyncEvery  time.Duration // full reconcile period besides watch events
	// ReconcileGap is the least time between two reconciles that store
	// watch events trigger (0: 100 ms); see pacer.
	ReconcileGap time.Duration
	// Source is the cluster's source of truth (nil: the etcd store at
	// EtcdEndpoints); the agent closes it.
	Source source.Backend
	// CNIConfDir, when set, gets skiff's CNI network configuration after
	// the first good reconcile: a Kubernetes node stays NotReady (no
	// network configuration) until the agent is ready.
	CNIConfDir string
	// Serves is what this host serves to the control plane (its embedded
	// etcd's client and peer URLs, its metrics address): published in its
	// host record and refused to every container of the cluster.
	Serves []string
}

// Agent is a running skiffd.
type Agent struct {
	cfg   Config
	log   *slog.Logger
	store source.Backend
	// fullMTU: a layer gives containers the underlay's MTU (overlay.Config.FullMTU).
	fullMTU bool

	// mu orders data-plane changes. A reconcile, which reads the store
	// and judges the kernel by it, holds it alone (a listing read before
	// an ADD that completes meanwhile would make the new endpoint look
	// stale); ADD, CHECK and DEL hold it shared, each with its container's
	// lock (containers), so that those of different containers run at
	// once. admit makes an ADD's look at the other endpoints (unshared)
	// and its record one step: two ADDs never both claim one cgroup or
	// MAC, nor race for one address; the ADDs that queue for it meanwhile
	// (admitting) are admitted together (admit.go). Order: mu, then a
	// container, then admit.
	mu         sync.RWMutex
	containers keyed
	admit      gate
	admitting  queue[*admission]
	maps       mapUse
	host       cluster.Host
	cluster    cluster.Config
	overlay    *overlay.Overlay
	control    overlay.ControlPlane // what the guard keeps containers from
	// layers are the optional layers this start runs, in order; unwanted
	// are the other registered ones, torn down at start.
	layers   []running
	unwanted []layer.Registration
	choices  []api.Layer // every registered layer: on, or off and why
	needs    layer.Needs // what any of the layers needs

	// listeners is the cluster's published listeners, kept by a watch
	// (when a layer needs them; nil until the watch runs). Guarded by mu.
	listeners source.Lister[cluster.Listener]
	// everyEndpoint is every host's endpoints, kept by a watch (when a
	// layer needs them; nil until the watch runs). Guarded by mu.
	everyEndpoint source.Lister[cluster.Endpoint]
	// synced is what the last reconcile read: a change of the listeners
	// alone syncs against its hosts and policy. Guarded by mu.
	synced *layer.View

	// Registration and resync failures, touched by the converge loop only.
	joinErr     error     // the last registration failure (nil: none)
	joinAt      time.Time // when to try registering again after joinErr
	joinBackoff backoff
	failures    quiet // "reconcile failed" warnings

	stateMu      sync.Mutex
	isRegistered bool // the store has confirmed this host since start
	storeErr     error
	syncErr      error
	lastSync     time.Time
	remotes      int
	endpoints    int
	local        []cluster.Endpoint
	reconciles   uint64 // reconciles run since start
	// conflistInstalled: CNIConfDir has the configuration (reconcile only).
	conflistInstalled bool
	eventsHeld        uint64 // watch events folded into a later reconcile
}

// running is one of the agent's layers.
type running struct {
	layer.Layer
	name  string
	needs layer.Needs
}

type identity struct {
	Cluster cluster.Config `json:"cluster"`
	Host    cluster.Host   `json:"host"`
}

// New validates cfg and connects to the store (without waiting for it).
func New(cfg Config, log *slog.Logger) (*Agent, error) {
	if cfg.Name == "" {
		return nil, errors.New("host name is empty")
	}
	if cfg.Layers == nil {
		cfg.Mode = cmp.Or(cfg.Mode, layer.Auto)
	}
	chosen, choices, err := layer.Choose(cfg.Mode, cfg.Layers, cfg.LayerOptions)
	if err != nil {
		return nil, err
	}
	layers, unwanted, err := newLayers(chosen, cfg.LayerOptions)
	if err != nil {
		return nil, err
	}
	if cfg.ResyncEvery == 0 {
		cfg.ResyncEvery = 30 * time.Second
	}
	if cfg.ReconcileGap == 0 {
		cfg.ReconcileGap = 100 * time.Millisecond
	}
	if err := cfg.Cluster.Validate(); err != nil {
		return nil, err
	}
	under, err := overlay.UnderlayAddr(cfg.Underlay)
	if err != nil {
		return nil, err
	}
	if under.Masked().Overlaps(cfg.Cluster.CIDR) {
		return nil, fmt.Errorf("cluster CIDR %s overlaps the underlay network %s of %s: choose another --cluster-cidr", cfg.Cluster.CIDR, under.Masked(), cfg.Underlay)
	}
	var served []netip.AddrPort
	for _, e := range cfg.Serves {
		addrs, port, err := resolveEndpoint(context.Background(), e)
		if err != nil {
			return nil, fmt.Errorf("control-plane address: %w", err)
		}
		for _, a := range addrs {
			served = append(served, netip.AddrPortFrom(a, port))
		}
	}
	control, err := controlPlane(context.Background(), cfg.EtcdEndpoints, served)
	if err != nil {
		return nil, err
	}
	src := cfg.Source
	if src == nil {
		s, err := store.Open(cfg.EtcdEndpoints, cfg.EtcdTLS)
		if err != nil {
			return nil, err
		}
		src = etcdSource{s}
	}
	a := &Agent{cfg: cfg, log: log, store: src, control: control, layers: layers, unwanted: unwanted, choices: choices,
		joinBackoff: backoff{min: time.Second, max: 30 * time.Second}, failures: quiet{period: 30 * time.Second}}
	for _, l := range layers {
		a.needs.Endpoints = a.needs.Endpoints || l.needs.Endpoints
		a.needs.Listeners = a.needs.Listeners || l.needs.Listeners
	}
	a.host = cluster.Host{Name: cfg.Name, UnderlayIP: under.Addr(), VTEPMAC: overlay.VTEPMAC(under.Addr()).String(), Control: served,
		Features: features(chosen, cfg.LayerOptions)}
	a.fullMTU = fullMTU(chosen, cfg.LayerOptions)
	return a, nil
}

// mode names the layer set: the mode, or the layers asked for.
func (a *Agent) mode() string {
	if a.cfg.Layers != nil {
		return "layers " + strings.Join(a.cfg.Layers, ",")
	}
	return a.cfg.Mode
}

// Run joins the cluster, builds the data plane, serves the API and converges
// until ctx ends. The data plane stays in place when Run returns.
func (a *Agent) Run(ctx context.Context) error {
	defer a.store.Close()
	if err := a.join(ctx); err != nil {
		return err
	}
	ov, err := overlay.New(overlay.Config{Cluster: a.cluster, Host: a.host, Underlay: a.cfg.Underlay, PinDir: a.pinDir(), UnderlayRate: a.cfg.UnderlayRate, FullMTU: a.fullMTU}, a.log)
	if err != nil {
		return err
	}
	if err := ov.Setup(); err != nil {
		return fmt.Errorf("set up overlay: %w", err)
	}
	defer ov.Close()
	a.overlay = ov
	// Layers an earlier run left that this one does not run go first: a
	// host switched to another mode carries nothing on their stale state.
	for _, r := range a.unwanted {
		if removed, err := r.Teardown(a.layerEnv(r.Name), a.cfg.LayerOptions[r.Name]); err != nil {
			return err
		} else if removed {
			a.log.Info("layer removed", "layer", r.Name, "mode", a.mode())
		}
	}
	for _, l := range a.layers {
		if err := l.Start(ctx, a.layerEnv(l.name)); err != nil {
			return fmt.Errorf("start layer %s: %w", l.name, err)
		}
		defer l.Close()
	}
	a.log.Info("overlay ready", "host", a.host.Name, "subnet", a.host.Subnet, "underlay", a.host.UnderlayIP, "mtu", ov.MTU(), "mode", a.mode())

	srv, err := a.Serve(a.cfg.Socket)
	if err != nil {
		return err
	}
	defer srv.Close()
	a.converge(ctx)
	a.log.Info("stopping; the data plane stays in place")
	return nil
}

// join registers the host. With a cached identity from an earlier run the
// agent does not need the store to start: it rebuilds the data plane from
// the cache and registers once the store answers.
func (a *Agent) join(ctx context.Context) error {
	cached, haveCache := a.loadIdentity()
	if haveCache && cached.Cluster != a.cfg.Cluster {
		return fmt.Errorf("this host was set up for cluster %+v (state in %s), not %+v", cached.Cluster, a.cfg.StateDir, a.cfg.Cluster)
	}
	var subnet netip.Prefix
	if haveCache {
		subnet = cached.Host.Subnet
	}
	wait := backoff{min: 250 * time.Millisecond, max: 10 * time.Second}
	for {
		err := a.tryJoin(ctx, subnet)
		if err == nil {
			return nil
		}
		if !errors.Is(err, source.ErrUnavailable) {
			return err
		}
		a.setStoreErr(err)
		if haveCache {
			a.log.Warn("cluster store unreachable; starting from cached identity", "err", err)
			a.cluster, a.host.Subnet = cached.Cluster, cached.Host.Subnet
			return nil
		}
		delay := wait.next()
		a.log.Warn("cluster store unreachable; retrying", "err", err, "in", delay)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
	}
}

// tryJoin registers the host at start: with the subnet its data plane
// served before (subnet, from the cached identity) unless another host
// holds it (ipam.Reclaim), else with the subnet the store holds for it or
// a new one (ipam.Join).
func (a *Agent) tryJoin(ctx context.Context, subnet netip.Prefix) error {
	c, err := a.store.EnsureCluster(ctx, a.cfg.Cluster)
	if err != nil {
		return err
	}
	h := a.host
	if subnet.IsValid() {
		h.Subnet = subnet
		repaired, err := a.store.Reclaim(ctx, c, h)
		switch {
		case errors.Is(err, source.ErrTaken):
			a.log.Warn("this host's subnet went to another host while it was away; taking a new one", "err", err)
			h.Subnet = netip.Prefix{}
		case err != nil:
			return fmt.Errorf("join cluster as %s: %w", h.Name, err)
		case repaired != "":
			a.log.Warn("repaired this host's registration in the cluster store", "repaired", repaired, "subnet", h.Subnet)
		}
	}
	if !h.Subnet.IsValid() {
		if h, err = a.store.Join(ctx, c, a.host); err != nil {
			return fmt.Errorf("join cluster as %s: %w", a.host.Name, err)
		}
	}
	a.cluster, a.host = c, h
	a.setStoreErr(nil)
	a.setRegistered(true)
	return a.saveIdentity()
}

func (a *Agent) identityPath() string { return filepath.Join(a.cfg.StateDir, "identity.json") }

func (a *Agent) loadIdentity() (identity, bool) {
	var id identity
	data, err := os.ReadFile(a.identityPath())
	if err != nil || json.Unmarshal(data, &id) != nil || id.Host.Name != a.host.Name {
		return id, false
	}
	return id, true
}

func (a *Agent) saveIdentity() error {
	if err := os.MkdirAll(a.cfg.StateDir, 0o755); err != nil {
		return fmt.Errorf("state directory: %w", err)
	}
	data, _ := json.MarshalIndent(identity{Cluster: a.cluster, Host: a.host}, "", "  ")
	tmp := a.identityPath() + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("save identity: %w", err)
	}
	return os.Rename(tmp, a.identityPath())
}

// converge reconciles on every store change and periodically, re-watching
// with backoff when the store goes away, and at once when it is back.
func (a *Agent) converge(ctx context.Context) {
	up := a.store.Connectivity(ctx, time.Second)
	wait := backoff{min: 250 * time.Millisecond, max: 10 * time.Second}
	for ctx.Err() == nil {
		if a.follow(ctx, up) {
			wait.reset()
		}
		if ctx.Err() != nil {
			return
		}
		delay := wait.next()
		a.log.Warn("store watch ended; retrying", "in", delay)
		timer := time.NewTimer(delay)
		for waiting := true; waiting; {
			select {
			case <-ctx.Done():
				timer.Stop()
				return
			case <-timer.C:
				waiting = false
			case back := <-up:
				waiting = !back
			}
		}
		timer.Stop()
	}
}

// follow reconciles, then again on every change, periodically, after a
// failure (with backoff) and when the connection to the store is back
// (up), until one of its watches ends (it ends the others) or ctx does. It
// reports whether the first reconcile succeeded.
func (a *Agent) follow(ctx context.Context, up <-chan bool) bool {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// A layer that needs every host's endpoints (the cache's caches name
	// them all) has a watch keep them, and each change reconciles.
	var endpoints <-chan struct{}
	if a.needs.Endpoints {
		endpoints = watchCache(ctx, a, "endpoints", &a.everyEndpoint, a.store.WatchEndpoints)
	}
	changed := a.store.Changes(ctx, a.host.Name, !a.needs.Endpoints)
	// Listeners come and go with every server start: they only change
	// the routes of the layers that need them (sockets), not worth a full
	// reconcile, nor a read of every listener of the cluster per change.
	var listeners <-chan struct{}
	if a.needs.Listeners {
		listeners = watchCache(ctx, a, "listeners", &a.listeners, a.store.WatchListeners)
	}
	ticker := time.NewTicker(a.cfg.ResyncEvery)
	defer ticker.Stop()
	retry := backoff{min: 250 * time.Millisecond, max: 10 * time.Second}
	var again <-chan time.Time // after a failed reconcile
	resync := func() bool {
		err := a.reconcile(ctx)
		if err == nil {
			retry.reset()
			again = nil
		} else {
			again = time.After(retry.next())
		}
		return err == nil
	}
	pace := pacer{gap: a.cfg.ReconcileGap}
	var trailing <-chan time.Time // the paced reconcile held events wait for
	watched := func() {
		run, arm := pace.event(time.Now())
		a.stateMu.Lock()
		a.eventsHeld = pace.held
		a.stateMu.Unlock()
		if arm > 0 {
			trailing = time.After(arm)
		}
		if run {
			resync()
		}
	}
	ok := resync()
	for {
		select {
		case <-ctx.Done():
			return ok
		case _, open := <-changed:
			if !open {
				return ok
			}
			watched()
		case _, open := <-endpoints:
			if !open {
				return ok
			}
			watched()
		case <-trailing:
			trailing = nil
			pace.due(time.Now())
			resync()
		case _, open := <-listeners:
			if !open {
				return ok
			}
			a.syncListeners(ctx)
		case <-ticker.C:
			resync()
		case <-again:
			resync()
		case back, open := <-up:
			if !open {
				return ok
			}
			if back {
				a.log.Info("connection to the cluster store is back; resyncing")
				resync()
			} else {
				a.log.Warn("lost the connection to the cluster store; not ready until it is back")
				a.setSyncErr(fmt.Errorf("connection lost: %w", source.ErrUnavailable))
			}
		}
	}
}

// waitAlone is how long a reconcile waits for the ADDs and DELs in flight
// before it queues for the data-plane lock like any writer.
const waitAlone = 10 * time.Second

// lockAlone takes a.mu alone (a reconcile). Until waitAlone it tries
// again every 10 ms rather than queue: a writer queued in a.mu holds up
// every later ADD behind the one in flight, and one ADD can stall for
// seconds on the kernel's RTNL lock in a burst of pods
// (docs/kubernetes.md "Performance").
func (a *Agent) lockAlone() {
	for deadline := time.Now().Add(waitAlone); !a.mu.TryLock(); {
		if time.Now().After(deadline) {
			a.mu.Lock()
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// slowReconcile is how long a reconcile may take before the agent logs
// where its time went ("reconcile slow": the lock, the store, each layer).
const slowReconcile = time.Second

// reconcile makes the data plane match the store.
func (a *Agent) reconcile(ctx context.Context) error {
	start := time.Now()
	a.stateMu.Lock()
	a.reconciles++
	a.stateMu.Unlock()
	err := a.reconcileOnce(ctx)
	a.log.Debug("reconciled", "took", time.Since(start), "err", err)
	if err == nil {
		a.failures = quiet{period: a.failures.period}
		a.installConflist()
	} else if ok, held := a.failures.pass(err.Error(), time.Now()); ok {
		a.log.Warn("reconcile failed", "err", err, "repeats", held)
	}
	a.setSyncErr(err)
	return err
}

// setSyncErr records the outcome of a sync (nil: success).
func (a *Agent) setSyncErr(err error) {
	a.stateMu.Lock()
	defer a.stateMu.Unlock()
	a.syncErr = err
	if errors.Is(err, source.ErrUnavailable) {
		a.storeErr = err
	} else {
		a.storeErr = nil
	}
	if err == nil {
		a.lastSync = time.Now()
	}
}

func (a *Agent) reconcileOnce(ctx context.Context) error {
	if err := a.register(ctx); err != nil {
		return err
	}
	// Read the store under the data-plane lock: a listing taken before an
	// ADD that completes in between would make the new endpoint look stale.
	steps := timing.Start(a.log, "reconcile slow", slowReconcile)
	defer steps.Done()
	a.lockAlone()
	defer a.mu.Unlock()
	steps.Step("lock")
	hosts, err := a.store.Hosts(ctx)
	if err != nil {
		return err
	}
	rules, err := a.store.Policies(ctx)
	if err != nil {
		return err
	}
	// This host's endpoints come from the store itself, read under the
	// lock (see above); a layer may also need every other host's.
	all, err := a.store.Endpoints(ctx, a.host.Name)
	if err != nil {
		return err
	}
	overrides, err := a.store.Limits(ctx, a.host.Name)
	if err != nil {
		return err
	}
	eps := store.WithLimits(slices.Clone(all), overrides)
	if a.needs.Endpoints {
		remote, err := a.remoteEndpoints(ctx)
		if err != nil {
			return err
		}
		all = append(all, store.Owned(hosts, remote)...) // no host speaks for another's addresses
	}
	v := &layer.View{Rules: rules, Hosts: hosts, Endpoints: all}
	var listenErr error // layers that need the listeners sit this round out without them
	if a.needs.Listeners {
		v.Listeners, listenErr = a.publishedListeners(ctx, hosts)
	}
	a.synced = v
	steps.Step("store")
	eps = a.collectGarbage(ctx, eps)
	v.Local = eps
	steps.Step("garbage")
	errs := errors.Join(
		listenErr,
		a.overlay.SyncHosts(hosts),
		a.overlay.SyncGuard(a.control, hosts),
		a.overlay.SyncBridgeNetfilter(),
		a.overlay.PruneEndpoints(eps),
		a.overlay.SyncSources(eps),
	)
	a.overlay.SyncLimits(eps)
	steps.Step("overlay")
	// The order with the layers is layer's package comment's: whether the
	// policy changed is known before the overlay applies it.
	v.PolicyChanged = a.overlay.PolicyChanged(rules)
	hold := false
	layers := slices.DeleteFunc(slices.Clone(a.layers), func(l running) bool { return l.needs.Listeners && listenErr != nil })
	for _, l := range layers {
		err := l.Sync(ctx, v)
		hold = hold || errors.Is(err, layer.ErrHoldPolicy)
		errs = errors.Join(errs, layerErr(l.name, err))
		steps.Step(l.name)
	}
	if !hold {
		errs = errors.Join(errs, a.overlay.SyncPolicy(rules, eps))
		steps.Step("overlay policy")
	}
	for _, l := range layers {
		errs = errors.Join(errs, layerErr(l.name, l.Settle(ctx, v)))
		steps.Step(l.name + " settle")
	}
	a.stateMu.Lock()
	a.remotes, a.endpoints, a.local = len(hosts)-1, len(eps), eps
	a.stateMu.Unlock()
	return errs
}

func layerErr(name string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("layer %s: %w", name, err)
}

// collectGarbage releases endpoints whose container namespace is gone (a
// runtime that never called DEL) — also when the path now names another
// namespace (a reused /proc/PID/ns/net) — and returns the rest.
func (a *Agent) collectGarbage(ctx context.Context, eps []cluster.Endpoint) []cluster.Endpoint {
	keep := eps[:0]
	for _, e := range eps {
		if e.NetnsHidden {
			keep = append(keep, e) // nothing here to judge it by: DEL removes it
			continue
		}
		ns, err := overlay.OpenNetns(e)
		if err == nil {
			ns.Close()
		}
		if errors.Is(err, overlay.ErrNetnsGone) || errors.Is(err, overlay.ErrNetnsChanged) {
			a.log.Info("releasing endpoint whose namespace is gone", "container", e.ContainerID, "ip", e.IP, "err", err)
			if err := a.overlay.RemoveEndpoint(e); err != nil {
				a.log.Warn("remove endpoint", "err", err)
			}
			if err := a.store.Release(ctx, e); err != nil {
				keep = append(keep, e)
			}
			continue
		}
		keep = append(keep, e)
	}
	return keep
}

// watchCache starts a watch-fed cache and keeps it in *into (guarded by
// a.mu), returning the channel that signals each change. The channel
// closes when the watch ends, and at once if it cannot start: the caller
// starts again.
func watchCache[T any](ctx context.Context, a *Agent, what string, into *source.Lister[T],
	watch func(context.Context) (source.Lister[T], <-chan struct{}, error)) <-chan struct{} {
	cache, changed, err := watch(ctx)
	a.mu.Lock()
	*into = cache
	a.mu.Unlock()
	if err != nil {
		a.log.Warn("watch "+what, "err", err)
		closed := make(chan struct{})
		close(closed)
		return closed
	}
	return changed
}

func (a *Agent) registered() bool {
	a.stateMu.Lock()
	defer a.stateMu.Unlock()
	return a.isRegistered
}

func (a *Agent) setRegistered(ok bool) {
	a.stateMu.Lock()
	a.isRegistered = ok
	a.stateMu.Unlock()
}

func (a *Agent) setStoreErr(err error) {
	a.stateMu.Lock()
	a.storeErr = err
	a.stateMu.Unlock()
}

// installConflist writes skiff's CNI configuration into CNIConfDir, when
// asked, once the agent has reconciled.
func (a *Agent) installConflist() {
	if a.cfg.CNIConfDir == "" || a.conflistInstalled {
		return
	}
	path := filepath.Join(a.cfg.CNIConfDir, cni.ConflistName)
	if have, err := os.ReadFile(path); err != nil || string(have) != cni.Conflist {
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(cni.Conflist), 0o644); err != nil {
			a.log.Warn("install the CNI configuration", "err", err)
			return
		}
		if err := os.Rename(tmp, path); err != nil {
			os.Remove(tmp)
			a.log.Warn("install the CNI configuration", "err", err)
			return
		}
		a.log.Info("installed the CNI configuration", "path", path)
	}
	a.conflistInstalled = true
}
