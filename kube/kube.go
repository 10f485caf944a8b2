// Package kube is skiff's source of truth in a Kubernetes cluster (skiffd
// --kubernetes): hosts are Nodes, a node's subnet is its spec.podCIDR (as
// kube-controller-manager --allocate-node-cidrs assigns it), its underlay
// address its InternalIP; the other hosts' endpoints are their pods; the
// policy is NetworkPolicy (package kube/netpol); this host's own records
// (its endpoints, its address leases) are files (package local); the
// listeners the sockets layer publishes are HostListeners objects
// (hostlisteners.skiff.dev, one per node). Backend implements
// source.Backend, so the agent runs the same code as on the etcd store.
package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	netlisters "k8s.io/client-go/listers/networking/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/kube/netpol"
	"github.com/skiffnet/skiff/local"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/source"
)

// Annotations skiff sets on its own Node.
const (
	AnnotationVTEPMAC = "skiff.dev/vtep-mac" // the VXLAN device's MAC
	// AnnotationFeatures lists what the node's data plane offers its peers
	// (cluster.Host.Features), comma-separated.
	AnnotationFeatures = "skiff.dev/features"
	AnnotationControl  = "skiff.dev/control" // what the host serves the control plane: addr:port, comma-separated
)

// ConfigMapName holds the cluster's overlay configuration in skiff's
// namespace: the first agent writes it, the others must agree.
const ConfigMapName = "skiff-cluster"

// Config is what the backend needs besides its clients.
type Config struct {
	Node      string // this host's Node name
	Namespace string // skiff's namespace (its ConfigMap)
	StateDir  string // this host's records go under StateDir/local
	Log       *slog.Logger
	// SyncTimeout bounds the wait for the informers' first list (default
	// one minute).
	SyncTimeout time.Duration
}

// Backend is the Kubernetes API as skiff's source of truth.
type Backend struct {
	cfg       Config
	client    kubernetes.Interface
	dyn       dynamic.Interface
	local     *local.Store
	stop      context.CancelFunc
	nodes     corelisters.NodeLister
	pods      corelisters.PodLister
	spaces    corelisters.NamespaceLister
	policies  netlisters.NetworkPolicyLister
	listeners cache.SharedIndexInformer // HostListeners, started on first use
	dynStart  func()

	mu      sync.Mutex
	subs    map[chan struct{}]kinds
	cluster cluster.Config // as EnsureCluster settled it
}

var _ source.Backend = (*Backend)(nil)

// What a change touches.
type kinds uint8

const (
	truth     kinds = 1 << iota // nodes, policies, namespaces, pods (policy inputs)
	endpoints                   // pods
	own                         // this host's records
	published                   // HostListeners
)

// New starts the informers and waits for their first list.
func New(ctx context.Context, cfg Config, client kubernetes.Interface, dyn dynamic.Interface) (*Backend, error) {
	if cfg.Node == "" {
		return nil, errors.New("kubernetes: the node's name is not set")
	}
	if cfg.SyncTimeout == 0 {
		cfg.SyncTimeout = time.Minute
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	st, freed, err := local.Open(filepath.Join(cfg.StateDir, "local"), cfg.Node)
	if err != nil {
		return nil, err
	}
	if len(freed) > 0 {
		cfg.Log.Warn("gave back address leases no endpoint held", "addrs", freed)
	}
	runCtx, stop := context.WithCancel(context.Background())
	b := &Backend{cfg: cfg, client: client, dyn: dyn, local: st, stop: stop, subs: map[chan struct{}]kinds{}}
	factory := informers.NewSharedInformerFactory(client, 0)
	b.nodes = factory.Core().V1().Nodes().Lister()
	b.pods = factory.Core().V1().Pods().Lister()
	b.spaces = factory.Core().V1().Namespaces().Lister()
	b.policies = factory.Networking().V1().NetworkPolicies().Lister()
	podInformer := factory.Core().V1().Pods().Informer()
	if err := podInformer.SetTransform(slimPod); err != nil {
		stop()
		return nil, err
	}
	for _, h := range []struct {
		informer cache.SharedIndexInformer
		k        kinds
		same     func(old, new any) bool
	}{
		{factory.Core().V1().Nodes().Informer(), truth, sameNode},
		{podInformer, truth | endpoints, samePod},
		{factory.Core().V1().Namespaces().Informer(), truth, sameLabels},
		{factory.Networking().V1().NetworkPolicies().Informer(), truth, sameSpec},
	} {
		if _, err := h.informer.AddEventHandler(b.handler(h.k, h.same)); err != nil {
			stop()
			return nil, err
		}
	}
	dynFactory := dynamicinformer.NewDynamicSharedInformerFactory(dyn, 0)
	b.listeners = dynFactory.ForResource(ListenersResource).Informer()
	if _, err := b.listeners.AddEventHandler(b.handler(published, nil)); err != nil {
		stop()
		return nil, err
	}
	b.dynStart = sync.OnceFunc(func() { dynFactory.Start(runCtx.Done()) })
	factory.Start(runCtx.Done())
	waitCtx, cancel := context.WithTimeout(ctx, cfg.SyncTimeout)
	defer cancel()
	for typ, ok := range factory.WaitForCacheSync(waitCtx.Done()) {
		if !ok {
			stop()
			return nil, fmt.Errorf("kubernetes: list %v: not synced within %s: %w", typ, cfg.SyncTimeout, source.ErrUnavailable)
		}
	}
	return b, nil
}

// slimPod keeps of a pod what skiff reads, so that the informer's cache of
// every pod of the cluster stays small.
func slimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a tombstone
	}
	slim := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID, Labels: p.Labels,
			ResourceVersion: p.ResourceVersion},
		Spec:   corev1.PodSpec{NodeName: p.Spec.NodeName, HostNetwork: p.Spec.HostNetwork},
		Status: corev1.PodStatus{Phase: p.Status.Phase, PodIP: p.Status.PodIP, PodIPs: p.Status.PodIPs},
	}
	for _, c := range p.Spec.Containers {
		if len(c.Ports) > 0 {
			slim.Spec.Containers = append(slim.Spec.Containers, corev1.Container{Name: c.Name, Ports: c.Ports})
		}
	}
	return slim, nil
}

// handler signals changes of k: every add and delete, and the updates
// same (nil: none) does not find equal for skiff. A kubelet rewrites its
// Node's status every few seconds, and pods' status moves with every
// probe: none of that is a change of skiff's view.
func (b *Backend) handler(k kinds, same func(old, new any) bool) cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { b.notify(k) },
		UpdateFunc: func(old, new any) {
			if same == nil || !same(old, new) {
				b.notify(k)
			}
		},
		DeleteFunc: func(any) { b.notify(k) },
	}
}

// sameNode: the same host to skiff (pod CIDR, InternalIP, skiff's
// annotations) and the same age (the oldest of a shared address wins).
func sameNode(old, new any) bool {
	o, ok1 := old.(*corev1.Node)
	n, ok2 := new.(*corev1.Node)
	if !ok1 || !ok2 {
		return false
	}
	ho, _ := nodeHost(o)
	hn, _ := nodeHost(n)
	return ho.Equal(hn) && n.CreationTimestamp.Equal(&o.CreationTimestamp)
}

// samePod: what slimPod keeps, but its resource version.
func samePod(old, new any) bool {
	o, ok1 := old.(*corev1.Pod)
	n, ok2 := new.(*corev1.Pod)
	if !ok1 || !ok2 {
		return false
	}
	a, b := o.DeepCopy(), n.DeepCopy()
	a.ResourceVersion, b.ResourceVersion = "", ""
	return equality.Semantic.DeepEqual(a, b)
}

// sameLabels: a namespace's labels, what namespace selectors read.
func sameLabels(old, new any) bool {
	o, ok1 := old.(metav1.Object)
	n, ok2 := new.(metav1.Object)
	return ok1 && ok2 && maps.Equal(o.GetLabels(), n.GetLabels())
}

// sameSpec: a NetworkPolicy's spec.
func sameSpec(old, new any) bool {
	o, ok1 := old.(*networkingv1.NetworkPolicy)
	n, ok2 := new.(*networkingv1.NetworkPolicy)
	return ok1 && ok2 && equality.Semantic.DeepEqual(o.Spec, n.Spec)
}

// notify signals every subscriber to k (coalesced: one pending signal).
func (b *Backend) notify(k kinds) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for ch, want := range b.subs {
		if want&k != 0 {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
}

// subscribe returns a channel signalled on changes of k until ctx ends.
func (b *Backend) subscribe(ctx context.Context, k kinds) <-chan struct{} {
	ch := make(chan struct{}, 1)
	b.mu.Lock()
	b.subs[ch] = k
	b.mu.Unlock()
	go func() {
		<-ctx.Done()
		b.mu.Lock()
		delete(b.subs, ch)
		b.mu.Unlock()
		close(ch)
	}()
	return ch
}

// Close stops the informers.
func (b *Backend) Close() error {
	b.stop()
	return nil
}

// Ping asks the API server whether it is ready.
func (b *Backend) Ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	_, err := b.client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
	return classify("ping the API server", err)
}

// Connectivity pings the API server and reports each change: every retry
// while it is down, every upPing while it answers (every node's agent
// pings it). The informers relist and rewatch by themselves.
func (b *Backend) Connectivity(ctx context.Context, retry time.Duration) <-chan bool {
	out := make(chan bool)
	go func() {
		defer close(out)
		up := true
		for {
			wait := retry
			if up {
				wait = max(retry, upPing)
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
			if now := b.Ping(ctx) == nil; now != up {
				up = now
				select {
				case out <- up:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out
}

// upPing is how often Connectivity checks an API server that answers.
const upPing = 10 * time.Second

// classify wraps an API error for the agent: unreachable or overloaded is
// source.ErrUnavailable (waiting mends it), refused is
// source.ErrPermission.
func classify(op string, err error) error {
	switch {
	case err == nil:
		return nil
	case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
		return fmt.Errorf("%s: %w: %w", op, source.ErrPermission, err)
	case apierrors.IsNotFound(err):
		return fmt.Errorf("%s: %w: %w", op, source.ErrNotFound, err)
	case apierrors.IsServerTimeout(err), apierrors.IsTimeout(err), apierrors.IsTooManyRequests(err),
		apierrors.IsServiceUnavailable(err), apierrors.IsInternalError(err), apierrors.ReasonForError(err) == metav1.StatusReasonUnknown:
		return fmt.Errorf("%s: %w: %w", op, source.ErrUnavailable, err)
	}
	return fmt.Errorf("%s: %w", op, err)
}

// EnsureCluster keeps the overlay's configuration in the ConfigMap: the
// first agent writes want, and an agent asking for another gets an error
// rather than a split cluster.
func (b *Backend) EnsureCluster(ctx context.Context, want cluster.Config) (cluster.Config, error) {
	if err := want.Validate(); err != nil {
		return cluster.Config{}, err
	}
	val, _ := json.Marshal(want)
	cms := b.client.CoreV1().ConfigMaps(b.cfg.Namespace)
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: ConfigMapName, Namespace: b.cfg.Namespace},
		Data: map[string]string{"cluster.json": string(val)}}
	_, err := cms.Create(ctx, cm, metav1.CreateOptions{})
	if err == nil {
		b.setCluster(want)
		return want, nil
	}
	if !apierrors.IsAlreadyExists(err) {
		return cluster.Config{}, classify("write the cluster configuration", err)
	}
	have, err := cms.Get(ctx, ConfigMapName, metav1.GetOptions{})
	if err != nil {
		return cluster.Config{}, classify("read the cluster configuration", err)
	}
	var c cluster.Config
	if err := json.Unmarshal([]byte(have.Data["cluster.json"]), &c); err != nil {
		return cluster.Config{}, fmt.Errorf("configmap %s/%s: cluster.json: %w", b.cfg.Namespace, ConfigMapName, err)
	}
	if c != want {
		return c, fmt.Errorf("cluster already configured as %+v, this agent asks for %+v", c, want)
	}
	b.setCluster(c)
	return c, nil
}

func (b *Backend) setCluster(c cluster.Config) {
	b.mu.Lock()
	b.cluster = c
	b.mu.Unlock()
}

func (b *Backend) clusterConfig() cluster.Config {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cluster
}

// Changes signals changes of the nodes, the policy and its inputs
// (NetworkPolicies, namespaces, pods) and, with ownEndpoints, of this
// host's records.
func (b *Backend) Changes(ctx context.Context, host string, ownEndpoints bool) <-chan struct{} {
	k := truth
	if ownEndpoints {
		k |= own
	}
	return b.subscribe(ctx, k)
}

// Policies is NetworkPolicy translated into skiff's rules. A pod this host
// gave an address before the API shows it is covered from its ADD on.
func (b *Backend) Policies(context.Context) (policy.Set, error) {
	pols, err := b.policies.List(labels.Everything())
	if err != nil {
		return nil, err
	}
	pods, err := b.pods.List(labels.Everything())
	if err != nil {
		return nil, err
	}
	spaces, err := b.spaces.List(labels.Everything())
	if err != nil {
		return nil, err
	}
	mine, err := b.local.Endpoints(b.cfg.Node)
	if err != nil {
		return nil, err
	}
	given := map[string]netip.Addr{}
	for _, e := range mine {
		if e.Pod != nil && e.Pod.UID != "" {
			given[e.Pod.UID] = e.IP.Addr()
		}
	}
	var in []netpol.Pod
	for _, p := range pods {
		var ip netip.Addr
		if p.Status.PodIP == "" && p.Spec.NodeName == b.cfg.Node {
			ip = given[string(p.UID)]
		}
		if np, ok := netpol.PodOf(p, ip); ok {
			in = append(in, np)
		}
	}
	namespaces := make(map[string]map[string]string, len(spaces))
	for _, n := range spaces {
		namespaces[n.Name] = n.Labels
	}
	set, err := netpol.Translate(pols, in, namespaces)
	if err != nil {
		b.cfg.Log.Warn("network policy left out", "err", err) // the rest is in force
	}
	return set, nil
}

// Limits: Kubernetes sets limits through the pod's bandwidth annotations
// (the CNI bandwidth capability), not overrides.
func (b *Backend) Limits(context.Context, string) (map[string]cluster.LimitOverride, error) {
	return map[string]cluster.LimitOverride{}, nil
}

// LimitOf is e: there are no overrides.
func (b *Backend) LimitOf(_ context.Context, e cluster.Endpoint) (cluster.Endpoint, error) {
	return e, nil
}

// Endpoint is one of this host's endpoints.
func (b *Backend) Endpoint(_ context.Context, host, containerID, ifName string) (cluster.Endpoint, error) {
	return b.local.Endpoint(host, containerID, ifName)
}

// PutEndpoint records a change of one of this host's endpoints.
func (b *Backend) PutEndpoint(_ context.Context, e cluster.Endpoint) error {
	defer b.notify(own | endpoints)
	return b.local.PutEndpoint(e)
}

// Allocate leases an address of this host's subnet.
func (b *Backend) Allocate(_ context.Context, subnet netip.Prefix, want cluster.Endpoint) (cluster.Endpoint, error) {
	defer b.notify(own | endpoints | truth) // a pod's address: a policy input
	return b.local.Allocate(subnet, want)
}

// Release gives an endpoint's address back.
func (b *Backend) Release(_ context.Context, e cluster.Endpoint) error {
	defer b.notify(own | endpoints | truth)
	return b.local.Release(e)
}

// Endpoints are host's endpoints: this host's own records, another
// node's pods, or ("") all of them.
func (b *Backend) Endpoints(_ context.Context, host string) ([]cluster.Endpoint, error) {
	var out []cluster.Endpoint
	if host == "" || host == b.cfg.Node {
		mine, err := b.local.Endpoints(b.cfg.Node)
		if err != nil {
			return nil, err
		}
		out = append(out, mine...)
	}
	if host == b.cfg.Node {
		return out, nil
	}
	pods, err := b.pods.List(labels.Everything())
	if err != nil {
		return nil, err
	}
	bits := b.clusterConfig().HostPrefix
	for _, p := range pods {
		if p.Spec.NodeName == b.cfg.Node || host != "" && p.Spec.NodeName != host {
			continue
		}
		if e, ok := podEndpoint(p, bits); ok {
			out = append(out, e)
		}
	}
	return out, nil
}

// podEndpoint is another node's pod as an endpoint: its address and node
// (what the data plane routes by).
func podEndpoint(p *corev1.Pod, bits int) (cluster.Endpoint, bool) {
	if p.Spec.NodeName == "" || p.Spec.HostNetwork || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
		return cluster.Endpoint{}, false
	}
	ip, err := netip.ParseAddr(p.Status.PodIP)
	if err != nil || !ip.Is4() || bits == 0 {
		return cluster.Endpoint{}, false
	}
	return cluster.Endpoint{Host: p.Spec.NodeName, IP: netip.PrefixFrom(ip, bits), ContainerID: string(p.UID), IfName: "eth0",
		Pod: &cluster.Pod{Namespace: p.Namespace, Name: p.Name, UID: string(p.UID)}}, true
}

// listerFunc is a Lister computed on each List.
type listerFunc[T any] func() []T

func (f listerFunc[T]) List() []T { return f() }

// WatchEndpoints follows every host's endpoints: pods, and this host's
// records.
func (b *Backend) WatchEndpoints(ctx context.Context) (source.Lister[cluster.Endpoint], <-chan struct{}, error) {
	changed := b.subscribe(ctx, endpoints|own)
	return listerFunc[cluster.Endpoint](func() []cluster.Endpoint {
		eps, err := b.Endpoints(ctx, "")
		if err != nil {
			b.cfg.Log.Warn("list endpoints", "err", err)
		}
		return eps
	}), changed, nil
}

// nodeHost is a Node as a skiff host; false while it lacks a pod CIDR, an
// InternalIP or skiff's annotations (its agent has not joined).
func nodeHost(n *corev1.Node) (cluster.Host, bool) {
	h := cluster.Host{Name: n.Name, UnderlayIP: internalIP(n), Subnet: podCIDR(n), VTEPMAC: n.Annotations[AnnotationVTEPMAC]}
	if !h.UnderlayIP.IsValid() || !h.Subnet.IsValid() || h.VTEPMAC == "" {
		return cluster.Host{}, false
	}
	for _, s := range strings.Split(n.Annotations[AnnotationControl], ",") {
		if ap, err := netip.ParseAddrPort(strings.TrimSpace(s)); err == nil {
			h.Control = append(h.Control, ap)
		}
	}
	for _, f := range strings.Split(n.Annotations[AnnotationFeatures], ",") {
		if f = strings.TrimSpace(f); f != "" {
			h.Features = append(h.Features, f)
		}
	}
	return h, true
}

func internalIP(n *corev1.Node) netip.Addr {
	for _, a := range n.Status.Addresses {
		if ip, err := netip.ParseAddr(a.Address); a.Type == corev1.NodeInternalIP && err == nil && ip.Is4() {
			return ip
		}
	}
	return netip.Addr{}
}

func podCIDR(n *corev1.Node) netip.Prefix {
	for _, s := range append([]string{n.Spec.PodCIDR}, n.Spec.PodCIDRs...) {
		if p, err := netip.ParsePrefix(s); err == nil && p.Addr().Is4() {
			return p.Masked()
		}
	}
	return netip.Prefix{}
}

// Hosts are the Nodes whose agents joined, with a subnet of the cluster's
// range and an underlay address that can be a host's. Of nodes publishing
// one address, the oldest stands for it.
func (b *Backend) Hosts(context.Context) ([]cluster.Host, error) {
	nodes, err := b.nodes.List(labels.Everything())
	if err != nil {
		return nil, err
	}
	slices.SortFunc(nodes, func(x, y *corev1.Node) int {
		if c := x.CreationTimestamp.Compare(y.CreationTimestamp.Time); c != 0 {
			return c
		}
		return strings.Compare(x.Name, y.Name)
	})
	c := b.clusterConfig()
	seen := map[netip.Addr]bool{}
	var out []cluster.Host
	for _, n := range nodes {
		h, ok := nodeHost(n)
		if !ok || seen[h.UnderlayIP] {
			continue
		}
		if why := cluster.UnderlayFault(h.UnderlayIP, c.CIDR); why != "" || !inRange(c, h.Subnet) {
			b.cfg.Log.Warn("node left out", "node", n.Name, "underlay", h.UnderlayIP, "subnet", h.Subnet, "why", why)
			continue
		}
		seen[h.UnderlayIP] = true
		out = append(out, h)
	}
	slices.SortFunc(out, func(x, y cluster.Host) int { return strings.Compare(x.Name, y.Name) })
	return out, nil
}

// inRange says whether p is a host subnet of c.
func inRange(c cluster.Config, p netip.Prefix) bool {
	return p.Bits() == c.HostPrefix && c.CIDR.Contains(p.Addr())
}

// Join registers this host: its Node's pod CIDR is its subnet (waiting,
// as source.ErrUnavailable, until the controller manager assigns one), its
// InternalIP must be the underlay address, and the node gets skiff's
// annotations.
func (b *Backend) Join(ctx context.Context, c cluster.Config, h cluster.Host) (cluster.Host, error) {
	h, _, err := b.register(ctx, c, h, false)
	return h, err
}

// Reclaim registers this host again with its subnet: source.ErrTaken when
// the node's pod CIDR is another now.
func (b *Backend) Reclaim(ctx context.Context, c cluster.Config, h cluster.Host) (string, error) {
	_, repaired, err := b.register(ctx, c, h, true)
	return repaired, err
}

func (b *Backend) register(ctx context.Context, c cluster.Config, h cluster.Host, keep bool) (cluster.Host, string, error) {
	n, err := b.client.CoreV1().Nodes().Get(ctx, h.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return cluster.Host{}, "", fmt.Errorf("node %s is not registered with the API server yet: %w", h.Name, source.ErrUnavailable)
	}
	if err != nil {
		return cluster.Host{}, "", classify("read node "+h.Name, err)
	}
	subnet := podCIDR(n)
	switch {
	case !subnet.IsValid():
		return cluster.Host{}, "", fmt.Errorf("node %s has no pod CIDR yet (kube-controller-manager --allocate-node-cidrs assigns them): %w", h.Name, source.ErrUnavailable)
	case !inRange(c, subnet):
		return cluster.Host{}, "", fmt.Errorf("node %s: pod CIDR %s is not a /%d of the cluster's range %s (kube-controller-manager's --cluster-cidr and --node-cidr-mask-size must match skiffd's --cluster-cidr and --host-prefix)",
			h.Name, subnet, c.HostPrefix, c.CIDR)
	case internalIP(n) != h.UnderlayIP:
		return cluster.Host{}, "", fmt.Errorf("node %s: its InternalIP %v is not this host's underlay address %s (--underlay)", h.Name, internalIP(n), h.UnderlayIP)
	case keep && subnet != h.Subnet:
		return cluster.Host{}, "", fmt.Errorf("subnet %s of %s: %w (the node's pod CIDR is %s now)", h.Subnet, h.Name, source.ErrTaken, subnet)
	}
	h.Subnet = subnet
	control := make([]string, 0, len(h.Control))
	for _, ap := range h.Control {
		control = append(control, ap.String())
	}
	want := map[string]string{AnnotationVTEPMAC: h.VTEPMAC, AnnotationControl: strings.Join(control, ","),
		AnnotationFeatures: strings.Join(h.Features, ",")}
	var changed []string
	for k, v := range want {
		if n.Annotations[k] != v {
			changed = append(changed, k)
		}
	}
	if len(changed) == 0 {
		return h, "", nil
	}
	slices.Sort(changed)
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": want}})
	// Through the status subresource, which an agent may patch (nodes/status):
	// it keeps metadata changes and not spec's.
	if _, err := b.client.CoreV1().Nodes().PatchStatus(ctx, h.Name, patch); err != nil {
		return cluster.Host{}, "", classify("annotate node "+h.Name, err)
	}
	return h, "node annotations " + strings.Join(changed, ","), nil
}
