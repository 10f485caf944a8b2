package kube

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stypes "k8s.io/apimachinery/pkg/types"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/source"
)

var testCluster = cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: 1, VXLANPort: 4789}

func node(name, ip, cidr string, age time.Duration, annotations map[string]string) *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: k8stypes.UID("uid-" + name), Annotations: annotations,
			CreationTimestamp: metav1.NewTime(time.Unix(1e9, 0).Add(-age))},
		Spec:   corev1.NodeSpec{PodCIDR: cidr},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: ip}}},
	}
}

func pod(ns, name, node, ip string, lbl map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: k8stypes.UID("uid-" + ns + "-" + name), Labels: lbl},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c"}}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip},
	}
}

// backend runs the backend for node h1 on fake clients holding objs.
func backend(t *testing.T, objs ...runtime.Object) (*Backend, *fake.Clientset, *dynamicfake.FakeDynamicClient) {
	t.Helper()
	client := fake.NewClientset(objs...)
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{ListenersResource: ListenersKind + "List"})
	b, err := New(context.Background(), Config{Node: "h1", Namespace: "skiff-system", StateDir: t.TempDir(), SyncTimeout: 5 * time.Second}, client, dyn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	if _, err := b.EnsureCluster(context.Background(), testCluster); err != nil {
		t.Fatal(err)
	}
	return b, client, dyn
}

// eventually polls cond until it holds (the informers deliver
// asynchronously).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("%s: not within 5 s", what)
}

// TestJoin: a node joins with its pod CIDR as subnet once it has one, and
// gets skiff's annotations; a pod CIDR outside the cluster's range or an
// InternalIP other than the underlay address is refused; a changed pod
// CIDR is ErrTaken for Reclaim.
func TestJoin(t *testing.T) {
	ctx := context.Background()
	b, client, _ := backend(t, node("h1", "10.99.0.1", "", 0, nil))
	me := cluster.Host{Name: "h1", UnderlayIP: netip.MustParseAddr("10.99.0.1"), VTEPMAC: "0e:5f:c0:00:00:01", Features: []string{"cache-rewrite"},
		Control: []netip.AddrPort{netip.MustParseAddrPort("10.99.0.1:9473")}}
	if _, err := b.Join(ctx, testCluster, me); !errors.Is(err, source.ErrUnavailable) || !strings.Contains(err.Error(), "no pod CIDR") {
		t.Fatalf("without a pod CIDR: %v", err)
	}
	setCIDR := func(cidr string) {
		n, _ := client.CoreV1().Nodes().Get(ctx, "h1", metav1.GetOptions{})
		n.Spec.PodCIDR = cidr
		if _, err := client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	setCIDR("10.245.1.0/24")
	if _, err := b.Join(ctx, testCluster, me); err == nil || !strings.Contains(err.Error(), "not a /24 of the cluster's range") {
		t.Fatalf("pod CIDR outside the range: %v", err)
	}
	setCIDR("10.244.7.0/24")
	other := me
	other.UnderlayIP = netip.MustParseAddr("10.99.0.9")
	if _, err := b.Join(ctx, testCluster, other); err == nil || !strings.Contains(err.Error(), "InternalIP") {
		t.Fatalf("another underlay address: %v", err)
	}
	h, err := b.Join(ctx, testCluster, me)
	if err != nil || h.Subnet.String() != "10.244.7.0/24" {
		t.Fatalf("join: %v %v", h.Subnet, err)
	}
	n, _ := client.CoreV1().Nodes().Get(ctx, "h1", metav1.GetOptions{})
	if n.Annotations[AnnotationVTEPMAC] != me.VTEPMAC || n.Annotations[AnnotationControl] != "10.99.0.1:9473" || n.Annotations[AnnotationFeatures] != "cache-rewrite" {
		t.Fatalf("annotations %v", n.Annotations)
	}
	if repaired, err := b.Reclaim(ctx, testCluster, h); err != nil || repaired != "" {
		t.Fatalf("reclaim of an unchanged node: %q %v", repaired, err)
	}
	setCIDR("10.244.8.0/24")
	if _, err := b.Reclaim(ctx, testCluster, h); !errors.Is(err, source.ErrTaken) {
		t.Fatalf("reclaim after the pod CIDR changed: %v", err)
	}
	if _, err := b.Join(ctx, cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24}, cluster.Host{Name: "nobody"}); !errors.Is(err, source.ErrUnavailable) {
		t.Fatalf("a node the API server does not know: %v", err)
	}
}

// TestEnsureCluster: the first agent writes the configuration, another
// asking for a different one is refused.
func TestEnsureCluster(t *testing.T) {
	b, _, _ := backend(t)
	other := testCluster
	other.VNI = 2
	if _, err := b.EnsureCluster(context.Background(), other); err == nil || !strings.Contains(err.Error(), "already configured") {
		t.Fatalf("a different configuration: %v", err)
	}
	if c, err := b.EnsureCluster(context.Background(), testCluster); err != nil || c != testCluster {
		t.Fatalf("the same: %v %v", c, err)
	}
}

// TestHosts: nodes whose agents joined are hosts; of two publishing one
// underlay address the older stands; addresses that cannot be a host's
// and subnets outside the range are left out; a deleted node is gone.
func TestHosts(t *testing.T) {
	ctx := context.Background()
	joined := func(mac string) map[string]string { return map[string]string{AnnotationVTEPMAC: mac} }
	b, client, _ := backend(t,
		node("h1", "10.99.0.1", "10.244.1.0/24", time.Hour, joined("m1")),
		node("h2", "10.99.0.2", "10.244.2.0/24", time.Hour, map[string]string{AnnotationVTEPMAC: "m2", AnnotationControl: "10.99.0.2:2379,10.99.0.2:9473", AnnotationFeatures: "cache-rewrite"}),
		node("old", "10.99.0.3", "10.244.3.0/24", 2*time.Hour, joined("m3")),
		node("young", "10.99.0.3", "10.244.4.0/24", time.Minute, joined("m4")),
		node("noagent", "10.99.0.5", "10.244.5.0/24", time.Hour, nil),
		node("nocidr", "10.99.0.6", "", time.Hour, joined("m6")),
		node("loop", "127.0.0.1", "10.244.7.0/24", time.Hour, joined("m7")),
		node("inside", "10.244.200.1", "10.244.8.0/24", time.Hour, joined("m8")),
		node("outside", "10.99.0.9", "10.245.9.0/24", time.Hour, joined("m9")),
	)
	hosts, err := b.Hosts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, h := range hosts {
		names = append(names, h.Name)
	}
	if want := []string{"h1", "h2", "old"}; !slices.Equal(names, want) {
		t.Fatalf("hosts %v, want %v", names, want)
	}
	if h := hosts[1]; h.UnderlayIP.String() != "10.99.0.2" || h.Subnet.String() != "10.244.2.0/24" || h.VTEPMAC != "m2" || len(h.Control) != 2 || !slices.Equal(h.Features, []string{"cache-rewrite"}) {
		t.Fatalf("h2 as %+v", h)
	}
	if err := client.CoreV1().Nodes().Delete(ctx, "h2", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a deleted node's host gone", func() bool {
		hosts, _ := b.Hosts(ctx)
		return len(hosts) == 2
	})
}

// TestEndpoints: other nodes' pods with an address are endpoints (not on
// the host's network, not finished); this host's are its own records.
func TestEndpoints(t *testing.T) {
	ctx := context.Background()
	finished := pod("default", "done", "h2", "10.244.2.9", nil)
	finished.Status.Phase = corev1.PodSucceeded
	hostNet := pod("default", "hn", "h2", "10.99.0.2", nil)
	hostNet.Spec.HostNetwork = true
	b, _, _ := backend(t,
		pod("default", "a", "h2", "10.244.2.5", nil),
		pod("default", "b", "h3", "10.244.3.5", nil),
		pod("default", "pending", "h2", "", nil),
		pod("default", "mine", "h1", "10.244.1.5", nil), // the API's view of a local pod: the records are the truth
		finished, hostNet)
	if _, err := b.Allocate(ctx, netip.MustParsePrefix("10.244.1.0/24"), cluster.Endpoint{Host: "h1", ContainerID: "c1", IfName: "eth0"}); err != nil {
		t.Fatal(err)
	}
	all, err := b.Endpoints(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range all {
		got = append(got, e.Host+" "+e.IP.String())
	}
	slices.Sort(got)
	if want := []string{"h1 10.244.1.2/24", "h2 10.244.2.5/24", "h3 10.244.3.5/24"}; !slices.Equal(got, want) {
		t.Fatalf("endpoints %v, want %v", got, want)
	}
	if mine, _ := b.Endpoints(ctx, "h1"); len(mine) != 1 || mine[0].ContainerID != "c1" {
		t.Fatalf("own endpoints %v", mine)
	}
	if h3, _ := b.Endpoints(ctx, "h3"); len(h3) != 1 || h3[0].Pod == nil || h3[0].Pod.Name != "b" {
		t.Fatalf("h3's endpoints %v", h3)
	}
}

// TestPoliciesAndChanges: NetworkPolicy becomes rules; a local pod the API
// shows no address for yet is covered by the address this host gave it;
// a label change signals Changes and changes the rules; a local
// allocation signals the endpoint watch.
func TestPoliciesAndChanges(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fresh := pod("prod", "fresh", "h1", "", map[string]string{"app": "db"})
	deny := &networkingv1.NetworkPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: "prod", Name: "db"},
		Spec: networkingv1.NetworkPolicySpec{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "db"}}}}
	b, client, _ := backend(t, fresh, pod("prod", "web", "h2", "10.244.2.5", map[string]string{"app": "web"}),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "prod"}}, deny)
	changes := b.Changes(ctx, "h1", true)
	_, watched, err := b.WatchEndpoints(ctx)
	if err != nil {
		t.Fatal(err)
	}
	set, _ := b.Policies(ctx)
	if len(set) != 0 {
		t.Fatalf("rules before the pod has an address: %v", set)
	}
	uid := string(fresh.UID)
	if _, err := b.Allocate(ctx, netip.MustParsePrefix("10.244.1.0/24"),
		cluster.Endpoint{Host: "h1", ContainerID: "c1", IfName: "eth0", Pod: &cluster.Pod{Namespace: "prod", Name: "fresh", UID: uid}}); err != nil {
		t.Fatal(err)
	}
	for name, ch := range map[string]<-chan struct{}{"changes": changes, "endpoints": watched} {
		select {
		case <-ch:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: no signal for a local allocation", name)
		}
	}
	set, _ = b.Policies(ctx)
	web, db := netip.MustParseAddr("10.244.2.5"), netip.MustParseAddr("10.244.1.2")
	if set.Allowed(policy.Flow{Src: web, Dst: db, Proto: policy.TCP, Port: 5432}) {
		t.Fatalf("isolated pod reachable: %v", set)
	}
	// The pod loses the label the policy selects: a change, and no rule.
	drain(changes)
	p, _ := client.CoreV1().Pods("prod").Get(ctx, "fresh", metav1.GetOptions{})
	p.Labels = map[string]string{"app": "other"}
	if _, err := client.CoreV1().Pods("prod").Update(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changes:
	case <-time.After(5 * time.Second):
		t.Fatal("no signal for a label change")
	}
	eventually(t, "rules follow the label change", func() bool {
		set, _ := b.Policies(ctx)
		return set.Allowed(policy.Flow{Src: web, Dst: db, Proto: policy.TCP, Port: 5432})
	})
	cancel()
	eventually(t, "channels close with their context", func() bool {
		_, open := <-changes
		return !open
	})
}

func drain(ch <-chan struct{}) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

// TestListeners: a node publishes its listeners in its HostListeners
// object (owned by the Node); the watch sees them, updates and clears.
func TestListeners(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, _, dyn := backend(t, node("h1", "10.99.0.1", "10.244.1.0/24", 0, nil))
	list, changed, err := b.WatchListeners(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ls := []cluster.Listener{{Host: "h1", Addr: netip.MustParseAddrPort("10.244.1.5:80")}, {Host: "h1", Addr: netip.MustParseAddrPort("10.244.1.2:443")}}
	if err := b.SetListeners(ctx, "h1", ls); err != nil {
		t.Fatal(err)
	}
	obj, err := dyn.Resource(ListenersResource).Get(ctx, "h1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if refs := obj.GetOwnerReferences(); len(refs) != 1 || refs[0].Kind != "Node" || refs[0].UID != "uid-h1" {
		t.Fatalf("owner %v", refs)
	}
	<-changed
	eventually(t, "the watch sees the listeners", func() bool { return len(list.List()) == 2 })
	if got, err := b.Listeners(ctx); err != nil || len(got) != 2 || got[0].Addr.String() != "10.244.1.2:443" {
		t.Fatalf("listeners %v %v", got, err)
	}
	if err := b.SetListeners(ctx, "h1", ls[:1]); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the watch sees the update", func() bool { return len(list.List()) == 1 })
	if err := b.SetListeners(ctx, "h1", nil); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the watch sees them cleared", func() bool { return len(list.List()) == 0 })
}

// TestQuietUpdates: a kubelet's status updates of its Node and of its
// pods' conditions are no changes to skiff; a pod CIDR, a label, an
// address are.
func TestQuietUpdates(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, client, _ := backend(t, node("h2", "10.99.0.2", "10.244.2.0/24", 0, map[string]string{AnnotationVTEPMAC: "m2"}),
		pod("default", "a", "h2", "10.244.2.5", map[string]string{"app": "a"}))
	changes := b.Changes(ctx, "h1", false)
	signalled := func(what string, want bool, change func()) {
		t.Helper()
		drain(changes)
		change()
		select {
		case <-changes:
			if !want {
				t.Errorf("%s: signalled", what)
			}
		case <-time.After(500 * time.Millisecond):
			if want {
				t.Errorf("%s: no signal", what)
			}
		}
	}
	nodes, pods := client.CoreV1().Nodes(), client.CoreV1().Pods("default")
	signalled("a Node's heartbeat", false, func() {
		n, _ := nodes.Get(ctx, "h2", metav1.GetOptions{})
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, LastHeartbeatTime: metav1.Now()}}
		nodes.UpdateStatus(ctx, n, metav1.UpdateOptions{})
	})
	signalled("a Node's pod CIDR", true, func() {
		n, _ := nodes.Get(ctx, "h2", metav1.GetOptions{})
		n.Spec.PodCIDR = "10.244.9.0/24"
		nodes.Update(ctx, n, metav1.UpdateOptions{})
	})
	signalled("a pod's conditions", false, func() {
		p, _ := pods.Get(ctx, "a", metav1.GetOptions{})
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
		pods.UpdateStatus(ctx, p, metav1.UpdateOptions{})
	})
	signalled("a pod's labels", true, func() {
		p, _ := pods.Get(ctx, "a", metav1.GetOptions{})
		p.Labels = map[string]string{"app": "b"}
		pods.Update(ctx, p, metav1.UpdateOptions{})
	})
	signalled("a pod's address", true, func() {
		p, _ := pods.Get(ctx, "a", metav1.GetOptions{})
		p.Status.PodIP = "10.244.2.6"
		pods.UpdateStatus(ctx, p, metav1.UpdateOptions{})
	})
}
