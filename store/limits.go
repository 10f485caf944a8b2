package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
)

// LimitKey is where the rate limit set with skiff limit for an endpoint is
// stored.
func LimitKey(host, containerID, ifName string) string {
	return LimitPrefix + host + "/" + containerID + "/" + ifName
}

// Limits returns the rate limits set with skiff limit on host's endpoints
// (every host's for ""), by endpoint key (KeyOf). One that does not
// validate (written past PutLimit) is not believed.
func (s *Store) Limits(ctx context.Context, host string) (map[string]cluster.LimitOverride, error) {
	p := LimitPrefix
	if host != "" {
		p += host + "/"
	}
	ls, err := list[cluster.LimitOverride](ctx, s, p)
	if err != nil {
		return nil, err
	}
	out := make(map[string]cluster.LimitOverride, len(ls))
	for _, l := range ls {
		if l.Limit.Validate() == nil {
			out[EndpointKey(l.Host, l.ContainerID, l.IfName)] = l
		}
	}
	return out, nil
}

// LimitOf returns e with its Limit the one in force: set with skiff limit
// (one read of its key), or else its runtime's.
func (s *Store) LimitOf(ctx context.Context, e cluster.Endpoint) (cluster.Endpoint, error) {
	var o cluster.LimitOverride
	err := s.getJSON(ctx, LimitKey(e.Host, e.ContainerID, e.IfName), &o)
	switch {
	case errors.Is(err, ErrNotFound):
		return e, nil
	case err != nil:
		return e, err
	}
	return WithLimits([]cluster.Endpoint{e}, map[string]cluster.LimitOverride{KeyOf(e): o})[0], nil
}

// PutLimit sets the rate limit of an existing endpoint, in the place of
// the one its runtime asked for. An endpoint that is gone is ErrNotFound:
// its limit would outlive it.
func (s *Store) PutLimit(ctx context.Context, o cluster.LimitOverride) error {
	if err := o.Limit.Validate(); err != nil {
		return err
	}
	val, _ := json.Marshal(o)
	ep := EndpointKey(o.Host, o.ContainerID, o.IfName)
	resp, err := s.Txn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(ep), ">", 0)},
		[]clientv3.Op{clientv3.OpPut(keyOf(o), string(val))})
	if err != nil {
		return err
	}
	if !resp.Succeeded {
		return fmt.Errorf("endpoint %s: %w", ep, ErrNotFound)
	}
	return nil
}

// DeleteLimit removes the limit set with skiff limit on an endpoint (its
// runtime's, if any, holds again). A missing one is ErrNotFound.
func (s *Store) DeleteLimit(ctx context.Context, host, containerID, ifName string) error {
	key := LimitKey(host, containerID, ifName)
	resp, err := s.Txn(ctx, nil, []clientv3.Op{clientv3.OpDelete(key)})
	if err != nil {
		return err
	}
	if resp.Responses[0].GetResponseDeleteRange().Deleted == 0 {
		return fmt.Errorf("no limit set with skiff limit on %s/%s: %w", containerID, ifName, ErrNotFound)
	}
	return nil
}

// WithLimits returns eps with each endpoint's Limit the one in force: set
// with skiff limit (overrides, as Limits returns them; one that does not
// validate is not believed) or else its runtime's.
func WithLimits(eps []cluster.Endpoint, overrides map[string]cluster.LimitOverride) []cluster.Endpoint {
	for i, e := range eps {
		if o, ok := overrides[KeyOf(e)]; ok && o.Limit.Validate() == nil {
			eps[i].Limit = o.Limit.Clamp()
		}
	}
	return eps
}
