package store

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
)

// ListenerCache holds the cluster's published listeners, kept current by a
// watch: an agent applies each change instead of reading every listener
// of the cluster again.
type ListenerCache struct {
	mu    sync.Mutex
	byKey map[string]cluster.Listener
}

// List returns the listeners, ordered by host and address.
func (c *ListenerCache) List() []cluster.Listener {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]cluster.Listener, 0, len(c.byKey))
	for _, l := range c.byKey {
		out = append(out, l)
	}
	slices.SortFunc(out, func(a, b cluster.Listener) int {
		return cmp.Or(cmp.Compare(a.Host, b.Host), a.Addr.Compare(b.Addr))
	})
	return out
}

// WatchListeners reads the published listeners once, then applies every
// change from a watch that starts where the read ended, signalling on the
// returned channel after each batch of changes (one pending signal at
// most). The channel closes when the watch ends (ctx done, the store
// away, its history compacted): the cache keeps the last state it saw,
// and the caller starts again.
func (s *Store) WatchListeners(ctx context.Context) (*ListenerCache, <-chan struct{}, error) {
	resp, err := s.get(ctx, ListenerPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, nil, err
	}
	c := &ListenerCache{byKey: make(map[string]cluster.Listener, len(resp.Kvs))}
	for _, kv := range resp.Kvs {
		if err := c.put(kv.Key, kv.Value); err != nil {
			return nil, nil, err
		}
	}
	out := make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	wc := s.Client.Watch(ctx, ListenerPrefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	go func() {
		defer close(out)
		defer cancel()
		for wr := range wc {
			if wr.Err() != nil || wr.Canceled {
				return
			}
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					c.mu.Lock()
					delete(c.byKey, string(ev.Kv.Key))
					c.mu.Unlock()
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

func (c *ListenerCache) put(key, val []byte) error {
	var l cluster.Listener
	if err := json.Unmarshal(val, &l); err != nil {
		return fmt.Errorf("decode %s: %w", key, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.byKey[string(key)] = l
	return nil
}
