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
// agent woken, at its pace. Writes take tokens of a bucket instead: a
// server that starts (a few listeners at once) is written at once, each
// change, as before; a loop empties the bucket and is then written once an
// interval, with whatever changed meanwhile, and only when the set differs
// from the one written last. Every resync the set is written whole
// (SetListeners compares it with the store and writes the difference), in
// case an event was lost or a write failed.
type publisher struct {
	host     string
	list     func() ([]cluster.Listener, error)
	store    layer.ListenerPublisher
	log      *slog.Logger
	burst    int           // writes back to back after a quiet spell
	interval time.Duration // then one write an interval
	resync   time.Duration

	mu        sync.Mutex
	st        Publish
	published []cluster.Listener // as last written; nil after a failure
	written   bool               // published holds a write's set
}

// Publishing pace: a new listener reaches the store at once, a loop of
// listens and closes once a second after its first five.
const (
	publishBurst    = 5
	publishInterval = time.Second
	publishResync   = 5 * time.Second
)

func newPublisher(host string, list func() ([]cluster.Listener, error), store layer.ListenerPublisher, log *slog.Logger) *publisher {
	return &publisher{host: host, list: list, store: store, log: log,
		burst: publishBurst, interval: publishInterval, resync: publishResync}
}

// run publishes the listeners at start, after changes (changed signals
// them) and every resync, until ctx ends or changed closes.
func (p *publisher) run(ctx context.Context, changed <-chan struct{}) {
	resync := time.NewTicker(p.resync)
	defer resync.Stop()
	p.publish(ctx, true)
	tokens, refilled := float64(p.burst), time.Now()
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
		now := time.Now()
		tokens = min(float64(p.burst), tokens+float64(now.Sub(refilled))/float64(p.interval))
		refilled = now
		if tokens < 1 {
			// Out of tokens: wait for the next, and write what changed
			// meanwhile with it.
			t := time.NewTimer(time.Duration((1 - tokens) * float64(p.interval)))
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			select {
			case <-changed:
			default:
			}
			tokens, refilled = 1, time.Now()
		}
		if p.publish(ctx, false) {
			tokens--
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
