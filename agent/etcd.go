package agent

import (
	"context"
	"net/netip"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/ipam"
	"github.com/skiffnet/skiff/source"
	"github.com/skiffnet/skiff/store"
)

// etcdSource is the etcd store as the agent's source of truth: the store's
// records, with subnets and addresses leased by package ipam.
type etcdSource struct{ *store.Store }

var (
	_ source.Backend        = etcdSource{}
	_ source.BatchAllocator = etcdSource{}
)

func (s etcdSource) Join(ctx context.Context, c cluster.Config, h cluster.Host) (cluster.Host, error) {
	return ipam.Join(ctx, s.Store, c, h)
}

func (s etcdSource) Reclaim(ctx context.Context, c cluster.Config, h cluster.Host) (string, error) {
	return ipam.Reclaim(ctx, s.Store, c, h)
}

func (s etcdSource) Allocate(ctx context.Context, subnet netip.Prefix, want cluster.Endpoint) (cluster.Endpoint, error) {
	return ipam.Allocate(ctx, s.Store, subnet, want)
}

func (s etcdSource) AllocateAll(ctx context.Context, subnet netip.Prefix, wants []cluster.Endpoint) ([]cluster.Endpoint, []error) {
	return ipam.AllocateAll(ctx, s.Store, subnet, wants)
}

func (s etcdSource) Release(ctx context.Context, e cluster.Endpoint) error {
	return ipam.Release(ctx, s.Store, e)
}

// Changes watches the hosts, their subnet claims (which host a record
// stands for depends on them: store.Hosts), the policy, host's limit
// overrides and, with ownEndpoints, host's endpoints.
func (s etcdSource) Changes(ctx context.Context, host string, ownEndpoints bool) <-chan struct{} {
	prefixes := []string{store.HostsPrefix, store.PolicyPrefix, store.SubnetsPrefix, store.LimitPrefix + host + "/"}
	if ownEndpoints {
		prefixes = append(prefixes, store.EndpointPrefix+host+"/")
	}
	return s.Watch(ctx, prefixes...)
}

func (s etcdSource) WatchEndpoints(ctx context.Context) (source.Lister[cluster.Endpoint], <-chan struct{}, error) {
	c, changed, err := s.Store.WatchEndpoints(ctx)
	if err != nil {
		return nil, nil, err // not a nil *Cache in a non-nil Lister
	}
	return c, changed, nil
}

func (s etcdSource) WatchListeners(ctx context.Context) (source.Lister[cluster.Listener], <-chan struct{}, error) {
	c, changed, err := s.Store.WatchListeners(ctx)
	if err != nil {
		return nil, nil, err
	}
	return c, changed, nil
}
