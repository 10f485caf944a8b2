package sockets

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
)

// publisher writes this host's replaced listeners to the cluster store,
// where other hosts' agents turn them into fast-path routes. Every listen
// and close is a kernel event, so a container that opens and closes
// listeners in a loop would otherwise have the store written, and every
// agent woken, at its pace: changes are gathered instead, and written at
// most once an interval, only when the set differs from the one written
// last. Every resync the set is written whole (SetListeners compares it
// with the store and writes the difference), in case an event was lost or
// a write failed.
type publisher struct {
	host     string
	list     func() ([]cluster.Listener, error)
	store    layer.ListenerPublisher
	log      *slog.Logger
	gather   time.Duration // after the first change, for the others that come with it
	interval time.Duration // at least this long between two writes
	resync   time.Duration

	mu        sync.Mutex
	st        Publish
	published []cluster.Listener // as last written; nil after a failure
	written   bool               // published holds a write's set
}

// Publishing pace: a new listener reaches the store about 100 ms after
// listen(), a loop of listens and closes at most once a second.
const (
	publishGather   = 100 * time.Millisecond
	publishInterval = time.Second
	publishResync   = 5 * time.Second
)

func newPublisher(host string, list func() ([]cluster.Listener, error), store layer.ListenerPublisher, log *slog.Logger) *publisher {
	return &publisher{host: host, list: list, store: store, log: log,
		gather: publishGather, interval: publishInterval, resync: publishResync}
}

// run publishes the listeners at start, after changes (changed signals
// them) and every resync, until ctx ends or changed closes.
func (p *publisher) run(ctx context.Context, changed <-chan struct{}) {
	resync := time.NewTicker(p.resync)
	defer resync.Stop()
	p.publish(ctx, true)
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-resync.C:
			p.publish(ctx, true)
			continue
		case _, ok := <-changed:
			if !ok {
				return
			}
		}
		wait := max(p.gather, time.Until(last.Add(p.interval)))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		// Changes signalled while waiting are in this write.
		select {
		case <-changed:
		default:
		}
		if p.publish(ctx, false) {
			last = time.Now()
		}
	}
}

// publish writes the listeners if they changed since the last write (or
// always, whole, with full): whether it wrote.
func (p *publisher) publish(ctx context.Context, full bool) bool {
	ls, err := p.list()
	if err != nil {
		p.failed(ctx, err)
		return false
	}
	p.mu.Lock()
	same := p.written && slices.Equal(ls, p.published)
	p.mu.Unlock()
	if same && !full {
		return false
	}
	if err := p.store.SetListeners(ctx, p.host, ls); err != nil {
		p.failed(ctx, err)
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !same {
		p.st.Writes++
		p.st.Last = time.Now()
	}
	p.published, p.written = ls, true
	p.st.Listeners, p.st.Error = len(ls), ""
	return !same
}

func (p *publisher) failed(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return
	}
	p.log.Warn("publish listeners", "err", err)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.published, p.written = nil, false
	p.st.Error = err.Error()
}

// stats reports what was published.
func (p *publisher) stats() *Publish {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.st
	return &st
}
