package agent

import "time"

// pacer spaces the reconciles that store watch events trigger. Every host
// may write its own record, so a host that rewrites it in a loop would
// otherwise make every other agent reconcile back to back (issue 40,
// item 9: 862 writes/s held each agent at about 24 % of a CPU). An event
// reconciles at once when the last paced reconcile is at least gap old;
// otherwise it is held for one trailing reconcile at the gap's end, which
// also carries every event held meanwhile, so the last change always
// lands, at most gap late. Periodic, retry and reconnect reconciles are
// not paced.
type pacer struct {
	gap     time.Duration
	last    time.Time // start of the last paced reconcile
	pending bool      // a trailing reconcile is due
	held    uint64    // events folded into a later reconcile
}

// event reports whether a watch event at now reconciles now; when not
// and no trailing reconcile was due yet, arm is how long until it is (0:
// one is already due, or the event runs now).
func (p *pacer) event(now time.Time) (run bool, arm time.Duration) {
	if p.pending {
		p.held++
		return false, 0
	}
	if wait := p.gap - now.Sub(p.last); wait > 0 && !p.last.IsZero() {
		p.pending = true
		p.held++
		return false, wait
	}
	p.last = now
	return true, 0
}

// due marks the trailing reconcile, run at now.
func (p *pacer) due(now time.Time) {
	p.pending = false
	p.last = now
}
