package kube

import (
	"context"
	"fmt"
	"net/netip"
	"slices"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/cache"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/source"
)

// ListenersResource is the HostListeners custom resource: one
// cluster-scoped object per node, named after it and owned by it (deleted
// with it), whose spec.listeners are the overlay addresses (addr:port) the
// node's sockets layer serves through host sockets
// (deploy/kubernetes/skiff.yaml defines it).
var ListenersResource = schema.GroupVersionResource{Group: "skiff.dev", Version: "v1alpha1", Resource: "hostlisteners"}

// ListenersKind is its kind.
const ListenersKind = "HostListeners"

// listenersOf reads one HostListeners object.
func listenersOf(obj *unstructured.Unstructured) []cluster.Listener {
	addrs, _, _ := unstructured.NestedStringSlice(obj.Object, "spec", "listeners")
	out := make([]cluster.Listener, 0, len(addrs))
	for _, a := range addrs {
		if ap, err := netip.ParseAddrPort(a); err == nil {
			out = append(out, cluster.Listener{Host: obj.GetName(), Addr: ap})
		}
	}
	return out
}

// Listeners are every node's published listeners, as the API server has
// them now.
func (b *Backend) Listeners(ctx context.Context) ([]cluster.Listener, error) {
	list, err := b.dyn.Resource(ListenersResource).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, classify("list hostlisteners", err)
	}
	var out []cluster.Listener
	for i := range list.Items {
		out = append(out, listenersOf(&list.Items[i])...)
	}
	return out, nil
}

// SetListeners makes host's HostListeners object hold ls.
func (b *Backend) SetListeners(ctx context.Context, host string, ls []cluster.Listener) error {
	addrs := make([]any, 0, len(ls))
	var sorted []string
	for _, l := range ls {
		sorted = append(sorted, l.Addr.String())
	}
	slices.Sort(sorted)
	for _, a := range sorted {
		addrs = append(addrs, a)
	}
	res := b.dyn.Resource(ListenersResource)
	have, err := res.Get(ctx, host, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		node, err := b.client.CoreV1().Nodes().Get(ctx, host, metav1.GetOptions{})
		if err != nil {
			return classify("read node "+host, err)
		}
		obj := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": ListenersResource.GroupVersion().String(),
			"kind":       ListenersKind,
			"metadata": map[string]any{
				"name": host,
				"ownerReferences": []any{map[string]any{
					"apiVersion": "v1", "kind": "Node", "name": node.Name, "uid": string(node.UID),
				}},
			},
			"spec": map[string]any{"listeners": addrs},
		}}
		_, err = res.Create(ctx, obj, metav1.CreateOptions{})
		return classify("create hostlisteners "+host, err)
	}
	if err != nil {
		return classify("read hostlisteners "+host, err)
	}
	if old, _, _ := unstructured.NestedStringSlice(have.Object, "spec", "listeners"); slices.Equal(old, sorted) {
		return nil
	}
	if err := unstructured.SetNestedSlice(have.Object, addrs, "spec", "listeners"); err != nil {
		return fmt.Errorf("hostlisteners %s: %w", host, err)
	}
	_, err = res.Update(ctx, have, metav1.UpdateOptions{})
	return classify("update hostlisteners "+host, err)
}

// WatchListeners follows every node's published listeners. The informer
// starts on first use; an API server without the HostListeners resource
// (the manifest not applied) is an error after the sync timeout.
func (b *Backend) WatchListeners(ctx context.Context) (source.Lister[cluster.Listener], <-chan struct{}, error) {
	changed := b.subscribe(ctx, published)
	b.dynStart()
	waitCtx, cancel := context.WithTimeout(ctx, b.cfg.SyncTimeout)
	defer cancel()
	if !cache.WaitForCacheSync(waitCtx.Done(), b.listeners.HasSynced) {
		return nil, nil, fmt.Errorf("kubernetes: list %s: not synced within %s (is deploy/kubernetes/skiff.yaml applied?): %w",
			ListenersResource, b.cfg.SyncTimeout, source.ErrUnavailable)
	}
	return listerFunc[cluster.Listener](func() []cluster.Listener {
		var out []cluster.Listener
		for _, obj := range b.listeners.GetStore().List() {
			if u, ok := obj.(*unstructured.Unstructured); ok {
				out = append(out, listenersOf(u)...)
			}
		}
		return out
	}), changed, nil
}
