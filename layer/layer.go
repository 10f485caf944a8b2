// Package layer is the interface between the agent and skiff's optional
// data-plane layers (cache, sockets, and those that come next), after
// flannel's backends: each layer is one package that registers itself
// (Register, from an init function) with its name, what it needs the agent
// to watch, and how to remove it; the agent starts the layers it runs and
// drives them, and tears down those it does not. The overlay is not a layer:
// it is the base every layer falls back to, always on.
//
// # Order of operations
//
// A reconcile reads the cluster into a View under the agent's data-plane
// lock, then, in this order:
//
//  1. The overlay syncs hosts, the control-plane guard, this host's
//     endpoints and their source check.
//  2. The agent records whether the policy differs from the one the overlay
//     enforces (View.PolicyChanged) — before the overlay applies it.
//  3. Every layer's Sync, in the order of the layer set. A layer that must
//     act before the new policy holds (pause learning, judge host-stack
//     input) does so here. If a layer's Sync returns ErrHoldPolicy (wrapped),
//     the overlay keeps its policy this round and the reconcile fails, to
//     be retried; any other error does not hold the policy back.
//  4. The overlay applies the policy.
//  5. Every layer's Settle: what must follow the policy (purge what it now
//     denies, resume learning). Settle runs even when Sync failed.
//
// AddEndpoint runs after the overlay attached the endpoint; a failure
// leaves the endpoint on the overlay (the layer attaches it again at a
// later Sync) and is the endpoint's, never the host's: a Sync does not
// fail for it (Attached). RemoveEndpoint runs before the overlay detaches it and
// before its address is released: nothing of a layer may reach a later
// holder of the address. A change of what only the layer watches
// (Needs.Listeners) calls Listeners with the last reconcile's view and the
// new listeners, without a reconcile.
//
// No layer may assume it is alone: layers share the host, its devices and
// the overlay, each in its own pin directory (Env.PinDir, <bpf-dir>/<name>),
// with its own tc filter names, iptables chains and map prefixes.
package layer

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
)

// Layer is one running data-plane layer of a host. The agent calls Start,
// Sync and Settle one at a time (under its data-plane lock, held alone);
// AddEndpoint and RemoveEndpoint of different containers may run at once
// (never with Sync or Settle, never two of one container); Endpoint and
// Status at any time.
type Layer interface {
	// Start loads the layer (reusing what an earlier run pinned) and
	// attaches its host-wide programs. Endpoints are attached by the first
	// Sync and by AddEndpoint. Goroutines it starts end with ctx.
	Start(ctx context.Context, env Env) error
	// AddEndpoint attaches the layer to a local container.
	AddEndpoint(ctx context.Context, e cluster.Endpoint) error
	// RemoveEndpoint forgets a local container.
	RemoveEndpoint(ctx context.Context, e cluster.Endpoint) error
	// Endpoint says whether the layer carries a local container's traffic
	// (what of it the layer can carry), and why not (Attached keeps what
	// attaching found).
	Endpoint(e cluster.Endpoint) (on bool, reason string)
	// Sync makes the layer coherent with the cluster, before the overlay
	// applies v's policy (see the package comment for the order).
	Sync(ctx context.Context, v *View) error
	// Settle finishes a reconcile after the overlay applied v's policy.
	Settle(ctx context.Context, v *View) error
	// Status reports the layer (counters, details, view, metrics); local
	// is this host's endpoints as the last reconcile found them.
	Status(local []cluster.Endpoint) Report
	// Close releases the process's handles and stops its helpers; the data
	// plane stays in place.
	Close() error
}

// Listening is a layer that needs the cluster's listeners (Needs.Listeners).
type Listening interface {
	Layer
	// Listeners applies a change of the published listeners alone: v is
	// the last reconcile's view with v.Listeners read anew.
	Listeners(ctx context.Context, v *View) error
}

// ErrHoldPolicy, wrapped in a layer's Sync error, keeps the overlay from
// applying a new policy in this reconcile.
var ErrHoldPolicy = errors.New("policy held back")

// Env is what the agent hands a layer.
type Env struct {
	Cluster  cluster.Config
	Host     cluster.Host
	Underlay string // underlay device
	PinDir   string // the layer's bpffs directory: <bpf-dir>/<name>
	StateDir string // the agent's state directory (shared; name files after the layer)
	// Listeners publishes this host's replaced listeners to the cluster
	// (the sockets layer's); a layer gets nothing else of the store.
	Listeners ListenerPublisher
	// Cgroups records a cgroup a layer learnt for a local endpoint whose
	// runtime passed none (the sockets layer, from the runtime's seccomp
	// hand-off).
	Cgroups CgroupRecorder
	Log     *slog.Logger
}

// CgroupRecorder records the cgroup of a local endpoint whose runtime
// passed none in CNI (containerd 1.6's CRI, for one): the endpoint of
// container id in the network namespace netnsDev/netnsIno, if it has no
// cgroup yet, gets cgroup (a path from the cgroup v2 root) in its record,
// and every layer attaches it again as the runtime's cgroupPath would
// have. It returns the endpoint as recorded.
type CgroupRecorder interface {
	RecordCgroup(ctx context.Context, id string, netnsDev, netnsIno uint64, cgroup string) (cluster.Endpoint, error)
}

// ListenerPublisher writes a host's listeners to the cluster store.
type ListenerPublisher interface {
	SetListeners(ctx context.Context, host string, ls []cluster.Listener) error
}

// Needs is what a layer needs the agent to watch and read.
type Needs struct {
	// Endpoints: every host's endpoints in View.Endpoints (not only this
	// host's), each change reconciling.
	Endpoints bool
	// Listeners: the cluster's published listeners in View.Listeners, each
	// change calling Listening.Listeners (the layer must implement it).
	Listeners bool
}

// View is the cluster as a reconcile read it.
type View struct {
	Rules policy.Set
	Hosts []cluster.Host
	// Local is this host's endpoints (those whose namespace is gone
	// already released).
	Local []cluster.Endpoint
	// Endpoints is this host's endpoints as read, and every other host's
	// (in subnets their hosts hold) when a layer needs them.
	Endpoints []cluster.Endpoint
	// Listeners is the cluster's published listeners in subnets their hosts
	// hold, when a layer needs them (nil otherwise).
	Listeners []cluster.Listener
	// PolicyChanged: Rules differ from what the overlay enforced before
	// this reconcile.
	PolicyChanged bool
}

// Same reports whether v and o read the same rules, hosts and endpoints.
func (v *View) Same(o *View) bool {
	return o != nil && slices.Equal(v.Rules, o.Rules) && slices.EqualFunc(v.Hosts, o.Hosts, cluster.Host.Equal) &&
		slices.EqualFunc(v.Endpoints, o.Endpoints, cluster.Endpoint.Equal)
}

// Registration is how a layer package makes itself known.
type Registration struct {
	Name  string
	Needs Needs
	// Probe says what this host lacks for the layer (a kernel feature, a
	// file system, a binary), or nil when it can run; options as for New.
	// It attaches nothing. Nil: the layer runs wherever skiff does.
	Probe func(options any) error
	// With names the layers this one serves with its options: it runs
	// only beside them (off in auto, an error when named, without them).
	// Nil: none.
	With func(options any) []string
	// New checks the layer's options (nil: defaults; else the type the
	// layer package documents) and returns the layer, not started.
	New func(options any) (Layer, error)
	// Manual, when set, keeps the layer out of auto with this reason: it
	// runs only when named (a mode of its name, or --layers).
	Manual string
	// Teardown removes what an earlier run of the layer left on the host
	// (programs, pins, rules, helpers), without loading it: the layer is not
	// wanted on this start, or skiffd --cleanup runs. options as for New.
	// It reports whether there was anything.
	Teardown func(env Env, options any) (bool, error)
	// Flags defines the layer's skiffd flags on fs (named --<name>-...)
	// and returns what makes its options from them once fs is parsed.
	// Nil: no flags, and nil options (the defaults).
	Flags func(fs *flag.FlagSet) FlagOptions
	// Features names what the layer, with options, offers other hosts:
	// the agent announces them in its host record (cluster.Host.Features),
	// and every host's layers read them in View.Hosts. Nil: none.
	Features func(options any) []string
	// FullMTU says whether the layer, with options, carries containers'
	// packets between hosts without the overlay's VXLAN headers, so that
	// containers get the underlay's MTU (overlay.Config.FullMTU). Nil: no.
	FullMTU func(options any) bool
}

var (
	mu         sync.Mutex
	registered = map[string]Registration{}
)

// Register adds a layer; it panics on a duplicate or incomplete
// registration (a programming error, found at init).
func Register(r Registration) {
	mu.Lock()
	defer mu.Unlock()
	if r.Name == "" || r.New == nil || r.Teardown == nil {
		panic(fmt.Sprintf("layer %q: registration needs a name, New and Teardown", r.Name))
	}
	if _, dup := registered[r.Name]; dup {
		panic(fmt.Sprintf("layer %q registered twice", r.Name))
	}
	registered[r.Name] = r
}

// Registered returns every registered layer, by name.
func Registered() []Registration {
	mu.Lock()
	defer mu.Unlock()
	var all []Registration
	for _, r := range registered {
		all = append(all, r)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].Name < all[j].Name })
	return all
}
