package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/source"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/version"
)

// Serve serves the API on a unix socket (Run does, on --socket).
func (a *Agent) Serve(socket string) (*http.Server, error) {
	if err := os.MkdirAll(filepath.Dir(socket), 0o755); err != nil {
		return nil, fmt.Errorf("socket directory: %w", err)
	}
	// A socket file left by a previous run would make Listen fail; nobody
	// answers on it (we are the agent), so remove it.
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove stale socket %s: %w", socket, err)
	}
	l, err := net.Listen("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", socket, err)
	}
	if err := os.Chmod(socket, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", a.handle(func(r *http.Request) (any, error) { return a.Status(r.Context()), nil }))
	mux.HandleFunc("POST /v1/endpoints", a.handle(func(r *http.Request) (any, error) {
		return decodeThen(r, a.AddEndpoint)
	}))
	mux.HandleFunc("POST /v1/endpoints/check", a.handle(func(r *http.Request) (any, error) {
		return decodeThen(r, a.CheckEndpoint)
	}))
	mux.HandleFunc("POST /v1/endpoints/delete", a.handle(func(r *http.Request) (any, error) {
		return decodeThen(r, func(ctx context.Context, req api.AddRequest) (any, error) {
			return struct{}{}, a.DeleteEndpoint(ctx, req)
		})
	}))
	mux.HandleFunc("GET /v1/endpoints", a.handle(func(r *http.Request) (any, error) {
		host := a.host.Name
		if r.URL.Query().Get("all") != "" {
			host = ""
		}
		eps, err := a.store.Endpoints(r.Context(), host)
		if err != nil {
			return nil, err
		}
		overrides, err := a.store.Limits(r.Context(), host)
		if err != nil {
			return nil, err
		}
		return a.endpointPaths(eps, overrides), nil
	}))
	mux.HandleFunc("GET /v1/layers/{name}", a.handle(func(r *http.Request) (any, error) { return a.InspectLayer(r.PathValue("name")) }))
	mux.HandleFunc("GET /v1/hosts", a.handle(func(r *http.Request) (any, error) { return a.store.Hosts(r.Context()) }))
	mux.HandleFunc("GET /v1/policies", a.handle(func(r *http.Request) (any, error) { return a.store.Policies(r.Context()) }))
	// Policy changes and host removal are the administrator's, with the
	// credential the agent does not hold: skiff makes them in the store.
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ConnContext: withPeer}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("API server stopped", "err", err)
		}
	}()
	a.log.Info("API listening", "socket", socket)
	return srv, nil
}

type peerKey struct{}

// withPeer keeps the pid of the process at the other end of an API
// connection (SO_PEERCRED, in the agent's pid namespace) in its context.
func withPeer(ctx context.Context, c net.Conn) context.Context {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return ctx
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return ctx
	}
	var cred *unix.Ucred
	raw.Control(func(fd uintptr) { cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
	if err != nil || cred == nil {
		return ctx
	}
	return context.WithValue(ctx, peerKey{}, int(cred.Pid))
}

// netnsPath is the path through which the agent reaches the namespace of
// a request, and whether the request's own path hides it: a runtime in
// another mount namespace (under ip netns exec, rootless, in a container)
// passes a path the agent cannot see, or that names something else here.
// The plugin's open descriptor (NetnsFD, as /proc/<its pid>/fd/<fd>) says
// what the namespace is; the path is used when it names the same one.
func netnsPath(ctx context.Context, req api.AddRequest) (path string, hidden bool, err error) {
	if req.NetnsFD <= 0 {
		return req.Netns, false, nil
	}
	pid, ok := ctx.Value(peerKey{}).(int)
	if !ok || pid <= 0 {
		return req.Netns, false, nil
	}
	byFD := fmt.Sprintf("/proc/%d/fd/%d", pid, req.NetnsFD)
	dev, ino, err := overlay.NetnsID(byFD)
	if err != nil {
		return "", false, badRequest(fmt.Errorf("the plugin's descriptor of %s: %w", req.Netns, err))
	}
	if d, i, err := overlay.NetnsID(req.Netns); err == nil && d == dev && i == ino {
		return req.Netns, false, nil
	}
	return byFD, true, nil
}

type requestError struct{ error }

func badRequest(err error) error { return requestError{err} }

func decodeThen[T any, R any](r *http.Request, f func(context.Context, T) (R, error)) (any, error) {
	var in T
	dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil {
		return nil, badRequest(fmt.Errorf("decode request: %w", err))
	}
	return f(r.Context(), in)
}

func (a *Agent) handle(f func(*http.Request) (any, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		out, err := f(r)
		w.Header().Set("Content-Type", "application/json")
		if err != nil {
			e := api.Error{Message: err.Error()}
			status := http.StatusInternalServerError
			var re requestError
			switch {
			case errors.As(err, &re):
				status = http.StatusBadRequest
			case errors.Is(err, source.ErrNotFound):
				status = http.StatusNotFound
			case errors.Is(err, source.ErrExhausted):
				status = http.StatusInsufficientStorage
			case errors.Is(err, source.ErrInUse), errors.Is(err, source.ErrNotInSubnet):
				status = http.StatusConflict
			case errors.Is(err, source.ErrUnavailable):
				status, e.Retry = http.StatusServiceUnavailable, true
			}
			a.log.Warn("API request failed", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
			w.WriteHeader(status)
			json.NewEncoder(w).Encode(e)
			return
		}
		json.NewEncoder(w).Encode(out)
	}
}

// Status reports the agent's view of its host and the cluster.
func (a *Agent) Status(ctx context.Context) api.Status {
	s, _ := a.status(ctx)
	return s
}

// status is Status and what each running layer reported.
func (a *Agent) status(ctx context.Context) (api.Status, []layer.Report) {
	pingErr := a.store.Ping(ctx)
	a.stateMu.Lock()
	defer a.stateMu.Unlock()
	s := api.Status{
		Host: a.host, Cluster: a.cluster, Mode: a.mode(), StoreReachable: pingErr == nil,
		Ready: pingErr == nil && a.isRegistered && a.syncErr == nil && !a.lastSync.IsZero(), Endpoints: a.endpoints,
		RemoteHosts: a.remotes, LastSync: a.lastSync, Version: version.String(),
		Reconciles: a.reconciles, ReconcileEventsHeld: a.eventsHeld,
	}
	if pingErr != nil {
		s.StoreError = pingErr.Error()
	}
	if a.overlay != nil {
		s.SourceDrops, _ = a.overlay.SourceDrops()
		s.PolicyDenies, _ = overlay.PolicyDenies()
		s.QoS, _ = a.overlay.QoSCounters()
	}
	s.Maps = a.maps.use(a.pinDir(), a.log)
	s.Layers = slices.Clone(a.choices)
	var reports []layer.Report
	for _, l := range a.layers {
		r := l.Status(a.local)
		reports = append(reports, r)
		if i := slices.IndexFunc(s.Layers, func(c api.Layer) bool { return c.Name == l.name }); i >= 0 {
			s.Layers[i] = layerStatus(s.Layers[i], r)
		}
	}
	if a.syncErr != nil {
		s.SyncError = a.syncErr.Error()
	}
	return s, reports
}

// endpointPaths adds to this host's endpoints which layers carry them.
// The layers answer under their own locks, as for Status.
// Limits are the ones in force, overrides those set with skiff limit.
func (a *Agent) endpointPaths(eps []cluster.Endpoint, overrides map[string]cluster.LimitOverride) []api.EndpointStatus {
	out := make([]api.EndpointStatus, 0, len(eps))
	for _, e := range store.WithLimits(eps, overrides) {
		_, set := overrides[store.KeyOf(e)]
		s := api.EndpointStatus{Endpoint: e, LimitSet: set}
		if e.Host == a.host.Name {
			for _, c := range a.choices {
				l := api.Layer{Name: c.Name, Reason: "layer off on this host"}
				if c.Reason != "" {
					l.Reason += ": " + c.Reason
				}
				if i := slices.IndexFunc(a.layers, func(r running) bool { return r.name == c.Name }); i >= 0 {
					l.On, l.Reason = a.layers[i].Endpoint(e)
				}
				s.Layers = append(s.Layers, l)
			}
		}
		out = append(out, s)
	}
	return out
}

// validate checks a request's container ID, interface name and network
// namespace as CNI's own libcni does, before anything is done with them:
// the ID names files and keys, the interface a link. DEL may come without a
// namespace (the runtime lost it).
func validate(req api.AddRequest, del bool) error {
	if err := cluster.ValidateContainerID(req.ContainerID); err != nil {
		return badRequest(err)
	}
	if err := cluster.ValidateIfName(req.IfName); err != nil {
		return badRequest(err)
	}
	if del && req.Netns == "" {
		return nil
	}
	if err := cluster.ValidateNetns(req.Netns); err != nil {
		return badRequest(err)
	}
	if req.MAC != "" {
		if _, err := cluster.ParseMAC(req.MAC); err != nil {
			return badRequest(err)
		}
	}
	if err := cluster.ValidateCgroup(req.Cgroup); err != nil {
		return badRequest(err)
	}
	if err := req.Limit.Validate(); err != nil {
		return badRequest(fmt.Errorf("rate limit: %w", err))
	}
	if req.IP.IsValid() && !req.IP.Is4() {
		return badRequest(fmt.Errorf("address %s: containers get IPv4 addresses", req.IP))
	}
	return nil
}

// holdsSkiffd refuses a container cgroup (a path as CNI passes it; ""
// is none) that is skiffd's own or above it.
func holdsSkiffd(cg string) error {
	if own := cgroup.Own(); cg != "" && within(own, cgroup.Rel(cg)) {
		return fmt.Errorf("cgroup %q holds skiffd itself (%s): a container's cgroup is its own", cg, own)
	}
	return nil
}

// unsharedAmong refuses an ADD whose cgroup or MAC is another local
// endpoint's (eps: this host's; holdsSkiffd has refused a cgroup holding
// skiffd itself): the sockets layer knows
// a container by its cgroup (one container would get another's identity,
// or the host's processes would all count as a container), the cache and
// the source check by its MAC. The same container's other interfaces
// share its cgroup.
func unsharedAmong(eps []cluster.Endpoint, req api.AddRequest) error {
	for _, e := range eps {
		if e.ContainerID == req.ContainerID && e.IfName == req.IfName {
			continue // this endpoint, added again
		}
		if req.Cgroup != "" && e.Cgroup != "" && e.ContainerID != req.ContainerID && cgroup.Rel(e.Cgroup) == cgroup.Rel(req.Cgroup) {
			return badRequest(fmt.Errorf("cgroup %q is container %s's", req.Cgroup, e.ContainerID))
		}
		if req.MAC != "" && strings.EqualFold(e.MAC, req.MAC) {
			return badRequest(fmt.Errorf("MAC %s is container %s's (%s)", req.MAC, e.ContainerID, e.IfName))
		}
	}
	return nil
}

// within reports whether cgroup path p is c or below it.
func within(p, c string) bool { return p == c || c == "/" || strings.HasPrefix(p, c+"/") }

func (a *Agent) attachment(e cluster.Endpoint, o overlay.Attachment) api.Attachment {
	return api.Attachment{Endpoint: e, Gateway: o.Gateway.String(), MTU: o.MTU, HostVethMAC: o.HostVethMAC,
		ContainerMAC: o.ContainerMAC, ClusterCIDR: a.cluster.CIDR.String()}
}

// AddEndpoint allocates an address for a container and attaches it.
func (a *Agent) AddEndpoint(ctx context.Context, req api.AddRequest) (api.Attachment, error) {
	start := time.Now()
	if err := validate(req, false); err != nil {
		return api.Attachment{}, err
	}
	// What the path names now is the namespace this ADD configures; every
	// later entry checks it is still that one (overlay.OpenNetns).
	nsPath, hidden, err := netnsPath(ctx, req)
	if err != nil {
		return api.Attachment{}, err
	}
	dev, ino, err := overlay.NetnsID(nsPath)
	if err != nil {
		return api.Attachment{}, badRequest(fmt.Errorf("network namespace: %w", err))
	}
	if !a.registered() {
		return api.Attachment{}, fmt.Errorf("host %s is not registered yet: %w", a.host.Name, source.ErrUnavailable)
	}
	a.mu.RLock()
	defer a.mu.RUnlock()
	defer a.containers.lock(req.ContainerID)()
	locked := time.Now()
	e, fresh, moved, err := a.admitEndpoint(ctx, req, dev, ino, hidden)
	if err != nil {
		return api.Attachment{}, err
	}
	// This request's way into the namespace (the record keeps the
	// runtime's path), with the limit in force (a re-ADD keeps one set
	// with skiff limit).
	here, err := a.store.LimitOf(ctx, e)
	if err != nil { // the next reconcile applies it
		a.log.Warn("limit set with skiff limit not read", "container", e.ContainerID, "err", err)
	}
	here.Netns, here.NetnsHidden = nsPath, false
	allocated := time.Now()
	att, err := a.overlay.AddEndpoint(here)
	if err != nil {
		if fresh {
			if rerr := a.store.Release(ctx, e); rerr != nil {
				a.log.Error("release address after failed attach", "ip", e.IP, "err", rerr)
			}
		}
		return api.Attachment{}, fmt.Errorf("attach %s: %w", req.ContainerID, err)
	}
	attached := time.Now()
	a.attachLayers(ctx, here)
	layered := time.Now()
	if !strings.EqualFold(e.MAC, att.ContainerMAC) || moved {
		e.MAC = att.ContainerMAC
		if err := a.store.PutEndpoint(ctx, e); err != nil {
			return api.Attachment{}, err
		}
	}
	// Where an ADD's time went: waiting for the agent's locks, the store
	// (admission and allocation), the overlay (veth, addresses, routes),
	// the layers, and writing the record.
	done := time.Now()
	a.log.Info("endpoint added", "container", e.ContainerID, "if", e.IfName, "ip", e.IP, "veth", e.Veth,
		"took_ms", millis(start, done), "wait_ms", millis(start, locked), "store_ms", millis(locked, allocated),
		"overlay_ms", millis(allocated, attached), "layers_ms", millis(attached, layered), "record_ms", millis(layered, done))
	return a.attachment(e, att), nil
}

// attachLayers gives a local endpoint every layer. The overlay carries it
// either way; without a layer it is only slower, and the layer attaches it
// again at a later sync. The caller holds a.mu (shared at least) and e's
// container's lock.
func (a *Agent) attachLayers(ctx context.Context, e cluster.Endpoint) {
	for _, l := range a.layers {
		if err := l.AddEndpoint(ctx, e); err != nil {
			a.log.Error("layer not attached; endpoint uses the overlay", "layer", l.name, "container", e.ContainerID, "err", err)
		}
	}
}

// RecordCgroup records the cgroup a layer learnt for a local endpoint
// whose runtime passed none (layer.CgroupRecorder), and attaches every
// layer to it again, as an ADD with that cgroupPath would have: each
// interface of container id in the network namespace dev/ino.
func (a *Agent) RecordCgroup(ctx context.Context, id string, dev, ino uint64, cg string) (cluster.Endpoint, error) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	defer a.containers.lock(id)()
	rec, changed, err := a.recordCgroup(ctx, id, dev, ino, cg)
	for _, e := range changed {
		here, err := a.store.LimitOf(ctx, e)
		if err != nil { // the next reconcile applies it
			here = e
		}
		a.attachLayers(ctx, here)
		a.log.Info("endpoint cgroup recorded", "container", e.ContainerID, "if", e.IfName, "cgroup", cg)
	}
	return rec, err
}

// recordCgroup is RecordCgroup's check and records, under a.admit (what
// unshared reads is written before the next ADD's look): an endpoint of
// the container and those whose record changed.
func (a *Agent) recordCgroup(ctx context.Context, id string, dev, ino uint64, cg string) (rec cluster.Endpoint, changed []cluster.Endpoint, err error) {
	a.admit.Lock()
	defer a.admit.Unlock()
	eps, err := a.store.Endpoints(ctx, a.host.Name)
	if err != nil {
		return rec, nil, err
	}
	// As at ADD: no cgroup that holds skiffd or is another container's.
	req := api.AddRequest{ContainerID: id, Cgroup: cg}
	if err := holdsSkiffd(cg); err != nil {
		return rec, nil, err
	}
	if err := unsharedAmong(eps, req); err != nil {
		return rec, nil, err
	}
	for _, e := range eps {
		if e.ContainerID != id || e.NetnsDev != dev || e.NetnsIno != ino {
			continue
		}
		if e.Cgroup != "" {
			if cgroup.Rel(e.Cgroup) != cgroup.Rel(cg) {
				return e, changed, fmt.Errorf("container %s has the cgroup %s already, not %s", id, e.Cgroup, cg)
			}
			rec = e
			continue
		}
		e.Cgroup = cg
		if err := a.store.PutEndpoint(ctx, e); err != nil {
			return e, changed, err
		}
		changed = append(changed, e)
		rec = e
	}
	if rec.ContainerID == "" {
		return rec, changed, fmt.Errorf("no local endpoint of container %s in that network namespace", id)
	}
	return rec, changed, nil
}

// CheckEndpoint verifies a container's attachment against the store and the kernel.
func (a *Agent) CheckEndpoint(ctx context.Context, req api.AddRequest) (api.Attachment, error) {
	if err := validate(req, false); err != nil {
		return api.Attachment{}, err
	}
	e, err := a.store.Endpoint(ctx, a.host.Name, req.ContainerID, req.IfName)
	if err != nil {
		return api.Attachment{}, err
	}
	if e.Netns != req.Netns {
		return api.Attachment{}, fmt.Errorf("endpoint is attached in %s, not %s", e.Netns, req.Netns)
	}
	nsPath, _, err := netnsPath(ctx, req)
	if err != nil {
		return api.Attachment{}, err
	}
	e.Netns, e.NetnsHidden = nsPath, false
	a.mu.RLock()
	defer a.mu.RUnlock()
	defer a.containers.lock(req.ContainerID)()
	att, err := a.overlay.CheckEndpoint(e)
	if err != nil {
		return api.Attachment{}, err
	}
	return a.attachment(e, att), nil
}

// DeleteEndpoint detaches a container and releases its address. Deleting an
// endpoint that is partly or wholly gone succeeds.
func (a *Agent) DeleteEndpoint(ctx context.Context, req api.AddRequest) error {
	if err := validate(req, true); err != nil {
		return err
	}
	start := time.Now()
	a.mu.RLock()
	defer a.mu.RUnlock()
	defer a.containers.lock(req.ContainerID)()
	locked := time.Now()
	e, err := a.store.Endpoint(ctx, a.host.Name, req.ContainerID, req.IfName)
	if errors.Is(err, source.ErrNotFound) {
		e = cluster.Endpoint{ContainerID: req.ContainerID, IfName: req.IfName, Host: a.host.Name,
			Veth: overlay.VethName(req.ContainerID, req.IfName), Netns: req.Netns}
		return a.overlay.RemoveEndpoint(e)
	}
	if err != nil {
		// Take the kernel state down anyway; the runtime retries DEL and the
		// address is released once the store answers.
		_ = a.overlay.RemoveEndpoint(cluster.Endpoint{IfName: req.IfName, Netns: req.Netns,
			Veth: overlay.VethName(req.ContainerID, req.IfName)})
		return err
	}
	// The namespace is entered only if the path (the request's, else the
	// recorded one) still names the one ADD configured: a reused
	// /proc/PID/ns/net is somebody else's (overlay.RemoveEndpoint).
	if req.Netns != "" {
		e.Netns = req.Netns
	}
	read := time.Now()
	for _, l := range a.layers {
		// Before the address is released: nothing may reach a future holder
		// of the address through what a layer learned for this one.
		if err := l.RemoveEndpoint(ctx, e); err != nil {
			return layerErr(l.name, err)
		}
	}
	layered := time.Now()
	if err := a.overlay.RemoveEndpoint(e); err != nil {
		return err
	}
	removed := time.Now()
	if err := a.store.Release(ctx, e); err != nil {
		return err
	}
	// Where a DEL's time went: waiting for the agent's lock, reading the
	// record, the layers, the overlay, releasing the address.
	done := time.Now()
	a.log.Info("endpoint deleted", "container", e.ContainerID, "if", e.IfName, "ip", e.IP,
		"took_ms", millis(start, done), "wait_ms", millis(start, locked), "store_ms", millis(locked, read),
		"layers_ms", millis(read, layered), "overlay_ms", millis(layered, removed), "release_ms", millis(removed, done))
	return nil
}

// millis is the time from one instant to another in milliseconds, to the
// microsecond (the logs' breakdowns of ADD and DEL).
func millis(from, to time.Time) float64 { return float64(to.Sub(from).Microseconds()) / 1000 }

// InspectLayer reports a running layer at length (skiff layer NAME): what
// it shows in the status, and more where it has more to show (its
// entries).
func (a *Agent) InspectLayer(name string) (api.Layer, error) {
	a.stateMu.Lock()
	defer a.stateMu.Unlock()
	for _, l := range a.layers {
		if l.name != name {
			continue
		}
		in, ok := l.Layer.(layer.Inspector)
		if !ok {
			return layerStatus(api.Layer{Name: name, On: true}, l.Status(a.local)), nil
		}
		r, err := in.Inspect()
		if err != nil {
			return api.Layer{}, err
		}
		return layerStatus(api.Layer{Name: name, On: true}, r), nil
	}
	return api.Layer{}, badRequest(fmt.Errorf("host %s does not run a layer %q (mode %s)", a.host.Name, name, a.mode()))
}

// layerStatus adds what a running layer reported to its status entry.
func layerStatus(l api.Layer, r layer.Report) api.Layer {
	l.Counters, l.View = r.Counters, r.View
	if r.Details != nil {
		if b, err := json.Marshal(r.Details); err == nil {
			l.Details = b
		}
	}
	return l
}
