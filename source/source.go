// Package source is what the agent asks of the cluster's source of truth:
// the cluster's configuration, its hosts and their subnets, the policy, the
// endpoints of every host, and this host's own records (its endpoints'
// addresses and attachments, rate-limit overrides, published listeners).
//
// The agent holds a Backend and nothing else of the store, so one code path
// serves every backend: the etcd store (package store, addresses leased by
// package ipam) for clusters of skiff's own, and the Kubernetes API where
// there is one (docs/design/kubernetes.md).
package source

import (
	"context"
	"errors"
	"net/netip"
	"time"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
)

// Errors a Backend reports, for errors.Is.
var (
	// ErrUnavailable: the source cannot be reached now; waiting mends it.
	ErrUnavailable = errors.New("cluster store unavailable")
	// ErrNotFound: no such record.
	ErrNotFound = errors.New("not found")
	// ErrPermission: the source refuses this client.
	ErrPermission = errors.New("the cluster store refuses this client")
	// ErrTaken: another host holds this host's subnet.
	ErrTaken = errors.New("subnet held by another host")
	// ErrExhausted: no address or subnet is left.
	ErrExhausted = errors.New("address space exhausted")
	// ErrInUse: the address asked for is another endpoint's.
	ErrInUse = errors.New("address in use")
	// ErrNotInSubnet: the address asked for is not of this host's subnet.
	ErrNotInSubnet = errors.New("not an address of this host's subnet")
)

// Lister holds a watched collection: List returns its current items.
type Lister[T any] interface{ List() []T }

// Backend is the cluster's source of truth as the agent sees it.
type Backend interface {
	Close() error
	// Ping checks that the source answers now.
	Ping(ctx context.Context) error
	// Connectivity reports each change of reachability, checking every
	// retry, until ctx ends.
	Connectivity(ctx context.Context, retry time.Duration) <-chan bool

	// EnsureCluster returns the cluster's configuration, setting it to
	// want where none is set; a different one is an error.
	EnsureCluster(ctx context.Context, want cluster.Config) (cluster.Config, error)
	// Join registers h with the subnet the source holds for it, or a new
	// one.
	Join(ctx context.Context, c cluster.Config, h cluster.Host) (cluster.Host, error)
	// Reclaim registers h again with its own subnet (ErrTaken when another
	// host holds it), repairing what is missing; repaired names what was.
	Reclaim(ctx context.Context, c cluster.Config, h cluster.Host) (repaired string, err error)
	// Hosts are the cluster's hosts, each with its subnet.
	Hosts(ctx context.Context) ([]cluster.Host, error)
	// Policies is the rule set in force.
	Policies(ctx context.Context) (policy.Set, error)
	// Changes signals (coalesced) each change of the hosts, the policy,
	// this host's rate-limit overrides, and, with ownEndpoints, this host's
	// endpoints, until ctx ends, when it closes.
	Changes(ctx context.Context, host string, ownEndpoints bool) <-chan struct{}

	// Endpoints are host's endpoints ("": every host's).
	Endpoints(ctx context.Context, host string) ([]cluster.Endpoint, error)
	// WatchEndpoints keeps every host's endpoints, signalling each change.
	WatchEndpoints(ctx context.Context) (Lister[cluster.Endpoint], <-chan struct{}, error)
	// Endpoint is one of host's endpoints (ErrNotFound).
	Endpoint(ctx context.Context, host, containerID, ifName string) (cluster.Endpoint, error)
	// PutEndpoint records an endpoint (its address leased by Allocate).
	PutEndpoint(ctx context.Context, e cluster.Endpoint) error
	// Allocate leases an address of subnet for want (its own IP when it
	// asks for one) and records the endpoint.
	Allocate(ctx context.Context, subnet netip.Prefix, want cluster.Endpoint) (cluster.Endpoint, error)
	// Release gives an endpoint's address back and forgets the endpoint.
	Release(ctx context.Context, e cluster.Endpoint) error

	// Limits are host's rate-limit overrides by endpoint key.
	Limits(ctx context.Context, host string) (map[string]cluster.LimitOverride, error)
	// LimitOf is e with the override set for it, if any.
	LimitOf(ctx context.Context, e cluster.Endpoint) (cluster.Endpoint, error)

	// Listeners are every host's published listeners.
	Listeners(ctx context.Context) ([]cluster.Listener, error)
	// SetListeners replaces host's published listeners.
	SetListeners(ctx context.Context, host string, ls []cluster.Listener) error
	// WatchListeners keeps every host's published listeners, signalling
	// each change.
	WatchListeners(ctx context.Context) (Lister[cluster.Listener], <-chan struct{}, error)
}

// BatchAllocator is a Backend that leases many endpoints of one host in
// one step (Allocate's outcome for each, in order): the agent admits the
// ADDs of a burst of pods together.
type BatchAllocator interface {
	AllocateAll(ctx context.Context, subnet netip.Prefix, wants []cluster.Endpoint) ([]cluster.Endpoint, []error)
}
