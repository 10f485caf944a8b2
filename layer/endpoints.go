package layer

import (
	"log/slog"
	"sync"

	"github.com/skiffnet/skiff/cluster"
)

// Attached tracks which local containers a layer carries: attached, or
// not with the reason. A container the layer cannot attach (an unusable
// cgroup, a veth gone) is that container's problem, never the host's: it
// keeps the paths below the layer (the overlay at least), is reported
// (Layer.Endpoint, skiff endpoints) and is tried again at every Sync. A
// container whose attachment changed (a new rate limit) is attached again.
// The zero value is ready to use.
type Attached struct {
	mu     sync.Mutex
	result map[string]attempt // by container ID/interface
}

// attempt is what the endpoint was attached as and the outcome (nil:
// attached).
type attempt struct {
	as  attachment
	err error
}

// attachment is what of an endpoint a layer attaches by: a change of any
// of it attaches the endpoint again. (Not its MAC, filled in after the
// layers' ADD, nor its namespace path, which an ADD may give another way.)
type attachment struct {
	ip                 string
	veth, cgroup       string
	netnsDev, netnsIno uint64
	limit              cluster.Limit
}

func attachmentOf(e cluster.Endpoint) attachment {
	return attachment{e.IP.String(), e.Veth, e.Cgroup, e.NetnsDev, e.NetnsIno, e.Limit}
}

func key(e cluster.Endpoint) string { return e.ContainerID + "/" + e.IfName }

// Add attaches e with attach, records the outcome and returns it.
func (a *Attached) Add(e cluster.Endpoint, attach func(cluster.Endpoint) error) error {
	_, err := a.add(e, attach)
	return err
}

// add also reports whether a failure is new: none before, or another.
func (a *Attached) add(e cluster.Endpoint, attach func(cluster.Endpoint) error) (bool, error) {
	err := attach(e)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.result == nil {
		a.result = map[string]attempt{}
	}
	old, seen := a.result[key(e)]
	a.result[key(e)] = attempt{attachmentOf(e), err}
	return err != nil && (!seen || old.err == nil || old.err.Error() != err.Error()), err
}

// Sync attaches every container of local not attached yet — all of them
// the first time (those that were there before the agent started), then
// the ones that failed or whose record changed — and forgets containers no
// longer local. A failure is logged when it is new.
func (a *Attached) Sync(local []cluster.Endpoint, attach func(cluster.Endpoint) error, log *slog.Logger) {
	keep := map[string]bool{}
	for _, e := range local {
		keep[key(e)] = true
		a.mu.Lock()
		last, seen := a.result[key(e)]
		a.mu.Unlock()
		if !seen || last.err != nil || last.as != attachmentOf(e) {
			if news, err := a.add(e, attach); news {
				log.Warn("container stays off the layer; tried again at every sync", "container", e.ContainerID, "ip", e.IP, "err", err)
			}
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for id := range a.result {
		if !keep[id] {
			delete(a.result, id)
		}
	}
}

// Remove forgets a container.
func (a *Attached) Remove(e cluster.Endpoint) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.result, key(e))
}

// Err returns why e is not attached: nil when it is, "not attached yet"
// before the first attempt.
func (a *Attached) Err(e cluster.Endpoint) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	last, seen := a.result[key(e)]
	if !seen {
		return errNotYet
	}
	return last.err
}

var errNotYet = notYet{}

type notYet struct{}

func (notYet) Error() string { return "not attached yet" }
