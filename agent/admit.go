package agent

import (
	"cmp"
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/source"
)

// admission is an ADD waiting to be admitted, and where its outcome goes.
type admission struct {
	req      api.AddRequest
	dev, ino uint64
	hidden   bool
	done     chan admitted // buffered: whoever admits it does not wait
}

// admitted is an admission's outcome: the endpoint as recorded, whether
// it is new, and whether the runtime recreated its sandbox (a re-ADD in
// another namespace, cgroup, ...).
type admitted struct {
	e            cluster.Endpoint
	fresh, moved bool
	err          error
}

// queue is a list many goroutines add to and one takes whole.
type queue[T any] struct {
	mu    sync.Mutex
	items []T
}

func (q *queue[T]) add(v T) {
	q.mu.Lock()
	q.items = append(q.items, v)
	q.mu.Unlock()
}

func (q *queue[T]) take() []T {
	q.mu.Lock()
	defer q.mu.Unlock()
	items := q.items
	q.items = nil
	return items
}

// admitEndpoint checks an ADD against this host's other endpoints
// (unshared) and records it with its address, under a.admit. The ADDs
// that queue while another batch is admitted are admitted together by
// whichever of them takes a.admit next: one read of the host's endpoints
// and one allocation (source.BatchAllocator) for all, so a burst of pods
// costs a few store round trips in a row, not four per pod.
func (a *Agent) admitEndpoint(ctx context.Context, req api.AddRequest, dev, ino uint64, hidden bool) (cluster.Endpoint, bool, bool, error) {
	ad := &admission{req: req, dev: dev, ino: ino, hidden: hidden, done: make(chan admitted, 1)}
	a.admitting.add(ad)
	for {
		// its answer, or a.admit to admit the waiting batch (its own among
		// them, unless a batch being admitted took it)
		select {
		case r := <-ad.done:
			return r.e, r.fresh, r.moved, r.err
		case a.admit.c() <- struct{}{}:
			if batch := a.admitting.take(); len(batch) > 0 {
				// the batch is every waiting ADD's: one caller leaving
				// does not cancel the others' (the store bounds each call)
				a.admitAll(context.WithoutCancel(ctx), batch)
			}
			a.admit.Unlock()
		}
	}
}

// gate is a lock a select can wait for beside something else: an ADD
// waits for its answer or for the lock, whichever comes first, not behind
// a batch it is not in.
type gate struct {
	once sync.Once
	ch   chan struct{}
}

func (g *gate) c() chan struct{} {
	g.once.Do(func() { g.ch = make(chan struct{}, 1) })
	return g.ch
}

func (g *gate) Lock()   { g.c() <- struct{}{} }
func (g *gate) Unlock() { <-g.c() }

// admitAll admits a batch, answering each admission.
func (a *Agent) admitAll(ctx context.Context, batch []*admission) {
	var eps []cluster.Endpoint
	var readErr error
	if slices.ContainsFunc(batch, func(ad *admission) bool { return ad.req.Cgroup != "" || ad.req.MAC != "" }) {
		eps, readErr = a.store.Endpoints(ctx, a.host.Name)
	}
	var admits []*admission
	var wants []cluster.Endpoint
	for _, ad := range batch {
		req := ad.req
		err := holdsSkiffd(req.Cgroup)
		switch {
		case err != nil:
			err = badRequest(err)
		case readErr != nil && (req.Cgroup != "" || req.MAC != ""):
			err = fmt.Errorf("read this host's endpoints: %w", readErr)
		default:
			err = unsharedAmong(eps, req)
		}
		if err != nil {
			ad.done <- admitted{err: err}
			continue
		}
		// The record is complete from the start — its namespace, and a MAC
		// (the runtime's, or one chosen here for the attach to give the
		// container) — so that a new endpoint is one write to the store:
		// one watch event, one reconcile on every other host.
		want := cluster.Endpoint{ContainerID: req.ContainerID, IfName: req.IfName, Host: a.host.Name,
			Veth: overlay.VethName(req.ContainerID, req.IfName), Netns: req.Netns, NetnsDev: ad.dev, NetnsIno: ad.ino,
			NetnsHidden: ad.hidden, Created: time.Now().UTC(), Cgroup: req.Cgroup, MAC: cmp.Or(req.MAC, newMAC()),
			ClusterRoute: req.ClusterRoute, Limit: req.Limit, Pod: req.Pod}
		if req.IP.IsValid() {
			want.IP = netip.PrefixFrom(req.IP, 32)
		}
		eps = append(eps, want) // the later ones of the batch may not share its cgroup or MAC
		admits, wants = append(admits, ad), append(wants, want)
	}
	got, errs := a.allocate(ctx, wants)
	for i, ad := range admits {
		ad.done <- a.admitted(ctx, ad, wants[i], got[i], errs[i])
	}
}

// newMAC is a random locally administered unicast MAC address.
func newMAC() string {
	b := make([]byte, 6)
	rand.Read(b)
	b[0] = b[0]&^1 | 2
	return net.HardwareAddr(b).String()
}

// allocate leases addresses for wants, at once where the store can.
func (a *Agent) allocate(ctx context.Context, wants []cluster.Endpoint) ([]cluster.Endpoint, []error) {
	if len(wants) == 0 {
		return nil, nil
	}
	if b, ok := a.store.(source.BatchAllocator); ok {
		return b.AllocateAll(ctx, a.host.Subnet, wants)
	}
	got, errs := make([]cluster.Endpoint, len(wants)), make([]error, len(wants))
	for i, want := range wants {
		got[i], errs[i] = a.store.Allocate(ctx, a.host.Subnet, want)
	}
	return got, errs
}

// admitted completes one admission from its allocation: a re-ADD that
// moved has its record follow it before the batch lets a.admit go (what
// the next batch's unshared reads: its cgroup and MAC).
func (a *Agent) admitted(ctx context.Context, ad *admission, want, e cluster.Endpoint, err error) admitted {
	if err != nil {
		return admitted{err: fmt.Errorf("allocate address: %w", err)}
	}
	req := ad.req
	fresh := e.Created.Equal(want.Created)
	// The same container and interface in a new namespace means the
	// runtime recreated the sandbox; the endpoint follows it.
	moved := e.Netns != req.Netns || e.NetnsDev != ad.dev || e.NetnsIno != ad.ino || e.Cgroup != req.Cgroup ||
		e.ClusterRoute != req.ClusterRoute || e.NetnsHidden != ad.hidden || e.Limit != req.Limit || !e.Pod.Equal(req.Pod) ||
		req.MAC != "" && !strings.EqualFold(e.MAC, req.MAC)
	e.Netns, e.NetnsDev, e.NetnsIno, e.Cgroup, e.ClusterRoute, e.NetnsHidden, e.Limit = req.Netns, ad.dev, ad.ino, req.Cgroup, req.ClusterRoute, ad.hidden, req.Limit
	e.Pod = req.Pod
	if moved {
		// the attach may give another MAC; the record then follows it
		if req.MAC != "" {
			e.MAC = req.MAC
		}
		if err := a.store.PutEndpoint(ctx, e); err != nil {
			return admitted{e: e, fresh: fresh, moved: moved, err: err}
		}
	}
	return admitted{e: e, fresh: fresh, moved: moved}
}
