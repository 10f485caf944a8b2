package store

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"sync"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
)

// Cache holds the values under a prefix of the store, kept current by a
// watch: an agent applies each change instead of reading the whole prefix
// again.
type Cache[T any] struct {
	mu    sync.Mutex
	byKey map[string]T
	order func(a, b T) int // nil: by key, as a read of the prefix lists them
}

// List returns the values in the cache's order.
func (c *Cache[T]) List() []T {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.order != nil {
		return slices.SortedFunc(maps.Values(c.byKey), c.order)
	}
	out := make([]T, 0, len(c.byKey))
	for _, k := range slices.Sorted(maps.Keys(c.byKey)) {
		out = append(out, c.byKey[k])
	}
	return out
}

func (c *Cache[T]) put(key, val []byte) error {
	v, ok, err := decode[T](key, val)
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !ok {
		delete(c.byKey, string(key)) // not believed (see decode)
		return nil
	}
	c.byKey[string(key)] = v
	return nil
}

func (c *Cache[T]) delete(key []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.byKey, string(key))
}

// WatchListeners keeps the cluster's published listeners, ordered by host
// and address.
func (s *Store) WatchListeners(ctx context.Context) (*Cache[cluster.Listener], <-chan struct{}, error) {
	return watchPrefix(ctx, s, ListenerPrefix, func(a, b cluster.Listener) int {
		return cmp.Or(cmp.Compare(a.Host, b.Host), a.Addr.Compare(b.Addr))
	})
}

// WatchEndpoints keeps every host's endpoints, in the order Endpoints
// lists them.
func (s *Store) WatchEndpoints(ctx context.Context) (*Cache[cluster.Endpoint], <-chan struct{}, error) {
	return watchPrefix[cluster.Endpoint](ctx, s, EndpointPrefix, nil)
}

// watchPrefix reads the values under prefix once, then applies every
// change from a watch that starts where the read ended, signalling on the
// returned channel after each batch of changes (one pending signal at
// most). The channel closes when the watch ends (ctx done, the store
// away, its history compacted, a value that does not decode): the cache
// keeps the last state it saw, and the caller starts again.
func watchPrefix[T any](ctx context.Context, s *Store, prefix string, order func(a, b T) int) (*Cache[T], <-chan struct{}, error) {
	resp, err := s.get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, nil, err
	}
	c := &Cache[T]{byKey: make(map[string]T, len(resp.Kvs)), order: order}
	for _, kv := range resp.Kvs {
		if err := c.put(kv.Key, kv.Value); err != nil {
			return nil, nil, err
		}
	}
	out := make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	wc := s.Client.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	go func() {
		defer close(out)
		defer cancel()
		for wr := range wc {
			if wr.Err() != nil || wr.Canceled {
				return
			}
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					c.delete(ev.Kv.Key)
				} else if c.put(ev.Kv.Key, ev.Kv.Value) != nil {
					return // the caller reads again, and reports the error
				}
			}
			select {
			case out <- struct{}{}:
			default: // a signal is already pending
			}
		}
	}()
	return c, out, nil
}
