package agent

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/store"

	// The layers skiffd can run: importing a layer's package registers it.
	_ "github.com/skiffnet/skiff/cache"
	_ "github.com/skiffnet/skiff/channels"
	_ "github.com/skiffnet/skiff/sockets"
	_ "github.com/skiffnet/skiff/steering"
)

// newLayers makes the chosen layers with their options (not started yet),
// and returns the other registered layers, to be torn down.
func newLayers(chosen []layer.Registration, options map[string]any) ([]running, []layer.Registration, error) {
	var layers []running
	for _, r := range chosen {
		l, err := r.New(options[r.Name])
		if err != nil {
			return nil, nil, err
		}
		if _, ok := l.(layer.Listening); r.Needs.Listeners && !ok {
			return nil, nil, fmt.Errorf("layer %s needs listeners but cannot take them", r.Name)
		}
		layers = append(layers, running{Layer: l, name: r.Name, needs: r.Needs})
	}
	var unwanted []layer.Registration
	for _, r := range layer.Registered() {
		if !slices.ContainsFunc(chosen, func(c layer.Registration) bool { return c.Name == r.Name }) {
			unwanted = append(unwanted, r)
		}
	}
	return layers, unwanted, nil
}

func (a *Agent) pinDir() string {
	if a.cfg.BPFDir != "" {
		return a.cfg.BPFDir
	}
	return filepath.Join(bpffs.Root, "skiff")
}

// layerEnv is what the agent hands layer name.
func (a *Agent) layerEnv(name string) layer.Env {
	return layer.Env{Cluster: a.cluster, Host: a.host, Underlay: a.cfg.Underlay,
		PinDir: filepath.Join(a.pinDir(), name), StateDir: a.cfg.StateDir, Listeners: a.store, Cgroups: a, Log: a.log.With("layer", name)}
}

// remoteEndpoints returns the other hosts' endpoints: from the watch, or
// from the store while there is none. The caller holds a.mu.
func (a *Agent) remoteEndpoints(ctx context.Context) ([]cluster.Endpoint, error) {
	var all []cluster.Endpoint
	if a.everyEndpoint != nil {
		all = a.everyEndpoint.List()
	} else {
		var err error
		if all, err = a.store.Endpoints(ctx, ""); err != nil {
			return nil, err
		}
	}
	return slices.DeleteFunc(all, func(e cluster.Endpoint) bool { return e.Host == a.host.Name }), nil
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

// syncListeners applies a change of the published listeners to the layers
// that need them. Hosts and policy are those of the last reconcile, which
// runs on every change of either: a listener change reads nothing from the
// store.
func (a *Agent) syncListeners(ctx context.Context) {
	a.lockAlone()
	defer a.mu.Unlock()
	if a.synced == nil {
		return // the first reconcile syncs them
	}
	listeners, err := a.publishedListeners(ctx, a.synced.Hosts)
	if err != nil {
		a.log.Warn("read listeners", "err", err)
		return
	}
	v := *a.synced
	v.Listeners, v.PolicyChanged = listeners, false
	for _, l := range a.layers {
		if !l.needs.Listeners {
			continue
		}
		if err := l.Layer.(layer.Listening).Listeners(ctx, &v); err != nil {
			a.log.Warn("sync listeners", "layer", l.name, "err", err)
		}
	}
}

// fullMTU says whether a chosen layer gives containers the underlay's MTU.
func fullMTU(chosen []layer.Registration, options map[string]any) bool {
	return slices.ContainsFunc(chosen, func(r layer.Registration) bool { return r.FullMTU != nil && r.FullMTU(options[r.Name]) })
}

// features are what the chosen layers announce in the host record.
func features(chosen []layer.Registration, options map[string]any) []string {
	var fs []string
	for _, r := range chosen {
		if r.Features != nil {
			fs = append(fs, r.Features(options[r.Name])...)
		}
	}
	slices.Sort(fs)
	return slices.Compact(fs)
}
