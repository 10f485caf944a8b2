package agent

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/sockets"
	"github.com/skiffnet/skiff/store"
)

func (a *Agent) socketsPinDir() string { return filepath.Join(a.pinDir(), "sockets") }

// startSockets loads the sockets layer (reusing pinned state), attaches its
// host-wide programs and publishes this host's replaced listeners whenever
// they change. Endpoints are attached by reconcile and on every add.
func (a *Agent) startSockets(ctx context.Context) (*sockets.Layer, error) {
	root := a.cfg.CgroupRoot
	if root == "" {
		var err error
		if root, err = sockets.CgroupRoot(); err != nil {
			return nil, err
		}
	} else if err := sockets.MountCgroup2(root); err != nil {
		return nil, err
	}
	l, err := sockets.Load(sockets.Config{Cluster: a.cluster, Host: a.host, Underlay: a.cfg.Underlay,
		PinDir: a.socketsPinDir(), Secure: a.cfg.SocketsSecure, CgroupRoot: root, Broker: a.cfg.Broker,
		StateDir: a.cfg.StateDir}, a.log)
	if err != nil {
		return nil, err
	}
	if err := l.Setup(); err != nil {
		l.Close()
		return nil, fmt.Errorf("set up sockets layer: %w", err)
	}
	changed, err := l.WatchListeners(ctx)
	if err != nil {
		l.Close()
		return nil, err
	}
	go a.publishListeners(ctx, l, changed)
	a.log.Info("sockets layer attached", "pins", a.socketsPinDir(), "cgroups", root, "secure", a.cfg.SocketsSecure)
	return l, nil
}

// stopSockets removes a sockets layer an earlier run left behind.
func (a *Agent) stopSockets() error {
	if !sockets.Pinned(a.socketsPinDir()) {
		return nil
	}
	if err := sockets.Teardown(a.socketsPinDir(), a.cfg.StateDir); err != nil {
		return fmt.Errorf("remove the sockets layer: %w", err)
	}
	a.log.Info("sockets layer removed", "mode", a.cfg.Mode)
	return nil
}

// publishListeners writes this host's replaced listeners to the store when
// the kernel reports a change, and every few seconds in case an event was
// lost or the store was away. Other hosts' agents turn them into fast-path
// routes.
func (a *Agent) publishListeners(ctx context.Context, l *sockets.Layer, changed <-chan struct{}) {
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		ls, err := l.LocalListeners()
		if err == nil {
			err = a.store.SetListeners(ctx, a.host.Name, ls)
		}
		if err != nil && ctx.Err() == nil {
			a.log.Warn("publish listeners", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case _, ok := <-changed:
			if !ok {
				return
			}
		case <-t.C:
		}
	}
}

// syncSockets applies a cluster change to the sockets layer: routes to the
// published listeners and the policy new fast-path connections are judged
// by, host subnets for anti-spoofing, programs and brokers for new
// containers; on a policy change it ends the replaced
// connections the new policy denies, and the overlay's policy judges the
// overlay packets the layer delivers to the host stack while it has rules.
// It runs before the overlay applies the rules, so a first rule is judged
// on INPUT as soon as on FORWARD.
func (a *Agent) syncSockets(ctx context.Context, rules policy.Set, hosts []cluster.Host, local []cluster.Endpoint, policyChanged bool) error {
	listeners, err := a.publishedListeners(ctx, hosts)
	if err != nil {
		return err
	}
	errs := []error{a.sockets.Sync(hosts, listeners, rules), a.sockets.PruneEndpoints(local)}
	if !a.socketsAttached {
		for _, e := range local {
			errs = append(errs, a.sockets.AddEndpoint(e))
		}
	}
	// Walking every TCP socket of the host is for policy changes (and the
	// first sync, which may follow one made while the agent was down).
	if policyChanged || !a.socketsAttached {
		errs = append(errs, a.sockets.JudgeInput(len(rules) > 0))
		n, err := a.sockets.Enforce(rules)
		if n > 0 {
			a.log.Info("ended replaced connections the policy denies", "connections", n)
		}
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	a.socketsAttached = true
	return nil
}

// publishedListeners returns the cluster's published listeners in subnets
// their hosts hold (store.Owned): from the watch, or from the store while
// there is none. The caller holds a.mu.
func (a *Agent) publishedListeners(ctx context.Context, hosts []cluster.Host) ([]cluster.Listener, error) {
	if a.listeners != nil {
		return store.Owned(hosts, a.listeners.List()), nil
	}
	ls, err := a.store.Listeners(ctx)
	return store.Owned(hosts, ls), err
}

// syncRoutes applies a change of the published listeners: only the
// sockets layer's routes depend on them. Hosts and policy are those of the
// last reconcile, which runs on every change of either: a listener change
// reads nothing from the store.
func (a *Agent) syncRoutes(ctx context.Context) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.synced == nil {
		return nil // the first reconcile syncs the routes
	}
	listeners, err := a.publishedListeners(ctx, a.synced.hosts)
	if err != nil {
		return err
	}
	return a.sockets.Sync(a.synced.hosts, listeners, a.synced.rules)
}

// socketsStatus reports the layer's counters, listeners and containers.
func (a *Agent) socketsStatus(local []cluster.Endpoint) *api.SocketsStatus {
	s := &api.SocketsStatus{}
	s.Counters, _ = a.sockets.Stats()
	if p, err := a.sockets.PolicyInForce(); err == nil && p != nil {
		s.Policy = &api.SocketsPolicy{Rules: p.Rules, Overflow: p.Overflow}
	}
	if ls, err := a.sockets.LocalListeners(); err == nil {
		for _, l := range ls {
			s.Listeners = append(s.Listeners, l.Addr.String())
		}
	}
	for _, e := range local {
		if !sockets.Replaced(e) {
			continue
		}
		c := api.SocketsContainer{ContainerID: e.ContainerID, IP: e.IP.Addr().String()}
		st := sockets.ReadBrokerStats(a.cfg.StateDir, e.ContainerID)
		c.HandedOut, c.Replaced, c.Fallback, c.Privileged = st.HandedOut, st.Replaced, st.Fallback, st.Privileged
		c.Broker = a.sockets.BrokerRunning(e.ContainerID)
		s.Containers = append(s.Containers, c)
	}
	return s
}
