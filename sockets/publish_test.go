package sockets

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/skiffnet/skiff/cluster"
)

// storeWrites records the listener sets written, as the store would keep
// them; fail makes the next write fail.
type storeWrites struct {
	mu   sync.Mutex
	sets [][]cluster.Listener
	fail bool
}

func (s *storeWrites) SetListeners(_ context.Context, _ string, ls []cluster.Listener) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail {
		s.fail = false
		return errors.New("store away")
	}
	s.sets = append(s.sets, slices.Clone(ls))
	return nil
}

func (s *storeWrites) written() [][]cluster.Listener {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.sets)
}

// TestPublisherGathers: a container that opens and closes a listener in a
// loop (a kernel event each) has its host's listeners written at most once
// a publish interval after the first few, not once an event, and the last
// write is the set in the end. A new listener after a quiet spell is
// written at once, not after an interval.
func TestPublisherGathers(t *testing.T) {
	var mu sync.Mutex
	var now []cluster.Listener
	list := func() ([]cluster.Listener, error) {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(now), nil
	}
	st := &storeWrites{}
	p := newPublisher("h1", list, st, slog.New(slog.NewTextHandler(io.Discard, nil)))
	p.burst, p.interval, p.resync = 3, 500*time.Millisecond, time.Hour
	changed := make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.run(ctx, changed) }()
	defer func() { cancel(); <-done }()
	signal := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	li := cluster.Listener{Host: "h1", Addr: netip.MustParseAddrPort("10.244.1.2:80")}

	// A second of listen/close, then the listener stays.
	start := time.Now()
	for i := 0; time.Since(start) < time.Second; i++ {
		mu.Lock()
		now = nil
		if i%2 == 0 {
			now = []cluster.Listener{li}
		}
		mu.Unlock()
		signal()
		time.Sleep(100 * time.Microsecond)
	}
	mu.Lock()
	now = []cluster.Listener{li}
	mu.Unlock()
	signal()
	elapsed := time.Since(start)
	time.Sleep(2 * p.interval)
	w := st.written()
	// The first write is at start, then the burst; then one an interval,
	// one more at the end.
	if limit := 1 + p.burst + int(elapsed/p.interval) + 1; len(w) > limit {
		t.Fatalf("%d writes in %v of listen/close, want at most %d", len(w), elapsed, limit)
	}
	if last := w[len(w)-1]; !slices.Equal(last, []cluster.Listener{li}) {
		t.Fatalf("last write %v, want %v", last, li)
	}

	// Quiet for a refill of the bucket: a change is written at once.
	time.Sleep(time.Duration(p.burst) * p.interval)
	li2 := cluster.Listener{Host: "h1", Addr: netip.MustParseAddrPort("10.244.1.2:81")}
	mu.Lock()
	now = append(now, li2)
	mu.Unlock()
	signal()
	deadline := time.Now().Add(p.interval / 2)
	for len(st.written()) == len(w) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if got := st.written(); len(got) != len(w)+1 || len(got[len(got)-1]) != 2 {
		t.Fatalf("a new listener after a quiet spell: writes %d → %d within %v", len(w), len(got), p.interval/2)
	}
	if s := p.stats(); s.Listeners != 2 || s.Error != "" {
		t.Fatalf("stats %+v", s)
	}
}

// TestPublisherRetries: a write that failed is tried again (at the resync)
// even though nothing changed since, and the failure shows until then.
func TestPublisherRetries(t *testing.T) {
	li := cluster.Listener{Host: "h1", Addr: netip.MustParseAddrPort("10.244.1.2:80")}
	st := &storeWrites{fail: true}
	p := newPublisher("h1", func() ([]cluster.Listener, error) { return []cluster.Listener{li}, nil }, st,
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	p.burst, p.interval, p.resync = 1, time.Millisecond, 50*time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.run(ctx, make(chan struct{})) }()
	defer func() { cancel(); <-done }()
	time.Sleep(10 * time.Millisecond)
	if s := p.stats(); s.Error == "" || len(st.written()) != 0 {
		t.Fatalf("after a failed write: stats %+v, %d writes", s, len(st.written()))
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(st.written()) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if s := p.stats(); len(st.written()) == 0 || s.Error != "" || s.Writes != 1 {
		t.Fatalf("after the resync: stats %+v, %d writes", s, len(st.written()))
	}
}
