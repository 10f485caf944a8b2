package agent

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/skiffnet/skiff/source"
)

// How the agent recovers from a damaged or lost store: it keeps its host
// record and subnet claim as its data plane has them (register), writing
// only what is missing or wrong; what fails is retried after a growing
// delay (backoff) and logged once per period while it keeps failing
// (quiet); a lost connection to the store makes the host not ready until a
// resync after the connection is back.

// backoff is a delay that doubles on each failure, from min up to max.
type backoff struct{ min, max, cur time.Duration }

func (b *backoff) next() time.Duration {
	b.cur = min(max(2*b.cur, b.min), b.max)
	return b.cur
}

func (b *backoff) reset() { b.cur = 0 }

// quiet passes a message once per period while it repeats, and says how
// many repeats of it it held back since; a different message passes at
// once.
type quiet struct {
	period time.Duration
	last   string
	at     time.Time
	held   int
}

func (q *quiet) pass(msg string, now time.Time) (ok bool, held int) {
	if msg == q.last && now.Sub(q.at) < q.period {
		q.held++
		return false, 0
	}
	if msg != q.last {
		q.held = 0
	}
	held, q.held = q.held, 0
	q.last, q.at = msg, now
	return true, held
}

// register makes the store hold this host's record and subnet claim as the
// data plane serves them: a record or claim deleted or garbled is written
// again, with the same subnet, unless another host holds it meanwhile
// (ipam.Reclaim); when both are right nothing is written.
// After a failure other than an unreachable store it returns that failure
// without trying again until a growing delay has passed. Only the converge
// loop calls it.
func (a *Agent) register(ctx context.Context) error {
	if a.joinErr != nil && time.Now().Before(a.joinAt) {
		return a.joinErr
	}
	if !a.registered() {
		// The identity came from the cache: check it is this cluster's.
		if _, err := a.store.EnsureCluster(ctx, a.cluster); err != nil {
			return a.joinFailed(err)
		}
	}
	repaired, err := a.store.Reclaim(ctx, a.cluster, a.host)
	if err != nil {
		if errors.Is(err, source.ErrTaken) {
			err = fmt.Errorf("%w: its containers are cut off; restart skiffd to take a new subnet, then re-create them", err)
		}
		return a.joinFailed(err)
	}
	if repaired != "" {
		a.log.Warn("repaired this host's registration in the cluster store", "repaired", repaired, "subnet", a.host.Subnet)
	}
	a.joinErr = nil
	a.joinBackoff.reset()
	a.setRegistered(true)
	return nil
}

func (a *Agent) joinFailed(err error) error {
	if errors.Is(err, source.ErrUnavailable) {
		return err // retried as the store returns
	}
	a.setRegistered(false)
	a.joinErr, a.joinAt = err, time.Now().Add(a.joinBackoff.next())
	return err
}
