package agent

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"time"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/cluster"
)

// startCache loads the fast path (reusing pinned maps from an earlier run)
// and attaches it to the underlay; endpoints are attached by the first
// reconcile and on every add.
func (a *Agent) startCache() (*cache.Cache, error) {
	dir := a.pinDir()
	c, err := cache.Load(cache.Config{Cluster: a.cluster, Host: a.host, Underlay: a.cfg.Underlay,
		PinDir: dir, Capacity: a.cfg.CacheCapacity}, a.log)
	if err != nil {
		return nil, err
	}
	if err := c.Setup(); err != nil {
		c.Close()
		return nil, fmt.Errorf("set up cache: %w", err)
	}
	a.log.Info("cache fast path attached", "pins", dir)
	return c, nil
}

// stopCache removes a fast path an earlier run in cache mode left behind,
// so a host switched back to overlay mode carries nothing on stale caches.
func (a *Agent) stopCache() error {
	dir := a.pinDir()
	if !cache.Pinned(dir) {
		return nil
	}
	if err := cache.Teardown(cache.Config{Cluster: a.cluster, PinDir: dir}); err != nil {
		return fmt.Errorf("remove the cache fast path: %w", err)
	}
	a.log.Info("cache fast path removed (mode is now overlay)", "pins", dir)
	return nil
}

func (a *Agent) pinDir() string {
	if a.cfg.BPFDir != "" {
		return a.cfg.BPFDir
	}
	return filepath.Join(bpffs.Root, "skiff")
}

// syncCache applies a cluster change with the cache: delete-and-reinitialize
// (ONCache §3.4). Learning pauses while a policy or host change is applied
// and stale entries go, so that a packet marked under the old state cannot
// teach the new one. Endpoint churn needs no pause (entries of deleted
// endpoints are purged either way, and nothing marks a packet for a flow to
// an address the overlay no longer delivers), so frequent container starts
// and stops never hold learning up.
func (a *Agent) syncCache(in *clusterView, local []cluster.Endpoint) error {
	policyChanged := a.overlay.PolicyChanged(in.rules)
	pause := policyChanged || a.cacheState == nil || !slices.EqualFunc(in.hosts, a.cacheState.hosts, cluster.Host.Equal)
	if pause {
		if err := a.cache.SetPaused(true); err != nil {
			return err
		}
	}
	err := a.overlay.SyncPolicy(in.rules)
	if err == nil && policyChanged {
		var n int
		n, err = a.cache.PurgeDenied(in.rules)
		if n > 0 {
			a.log.Info("purged cached flows the policy denies", "flows", n)
		}
	}
	errs := []error{err, a.cache.Sync(in.endpoints, in.hosts)}
	if pause {
		// A packet marked established under the old state and still queued
		// must not teach the cache after the purge.
		time.Sleep(5 * time.Millisecond)
		errs = append(errs, a.cache.SetPaused(false))
	}
	// Endpoints added while the agent runs are attached by AddEndpoint; the
	// ones that existed before it started are attached once, here.
	if !a.cacheAttached {
		for _, e := range local {
			errs = append(errs, a.cache.AddEndpoint(e))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	a.cacheAttached = true
	return nil
}
