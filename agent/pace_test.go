package agent

import (
	"testing"
	"time"
)

// TestPacerBoundsReconciles: 1 000 watch events in one second (one host
// rewriting its record) give at most one reconcile per gap, the first at
// once and a trailing one after the last event.
func TestPacerBoundsReconciles(t *testing.T) {
	const gap = 100 * time.Millisecond
	p := pacer{gap: gap}
	start := time.Unix(1000, 0)
	var runs []time.Time
	var trailing time.Time // zero: none armed
	for i := range 1000 {
		now := start.Add(time.Duration(i) * time.Millisecond)
		if !trailing.IsZero() && !now.Before(trailing) {
			p.due(trailing)
			runs = append(runs, trailing)
			trailing = time.Time{}
		}
		run, arm := p.event(now)
		if run {
			runs = append(runs, now)
		}
		if arm > 0 {
			trailing = now.Add(arm)
		}
	}
	last := start.Add(999 * time.Millisecond)
	if trailing.IsZero() || trailing.Before(last) || trailing.Sub(last) > gap {
		t.Fatalf("no trailing reconcile within %v after the last event (armed %v)", gap, trailing)
	}
	p.due(trailing)
	runs = append(runs, trailing)
	if len(runs) > 11 {
		t.Errorf("%d reconciles for 1 000 events in 1 s, want at most 11", len(runs))
	}
	if !runs[0].Equal(start) {
		t.Errorf("first reconcile at %v, want at once", runs[0].Sub(start))
	}
	for i := 1; i < len(runs); i++ {
		if d := runs[i].Sub(runs[i-1]); d < gap {
			t.Errorf("reconciles %d and %d %v apart, want at least %v", i-1, i, d, gap)
		}
	}
	if p.held != 999 {
		t.Errorf("held %d events, want 999 (all but the first)", p.held)
	}
	// Quiet afterwards: the next event runs at once.
	if run, _ := p.event(trailing.Add(gap)); !run {
		t.Error("an event a gap after the last reconcile was held")
	}
}
