package lab

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/lab/labtest"
)

// kubeClusterCIDR is the pods' range the controller manager divides into
// the Nodes' podCIDRs (the lab's cluster CIDR by default).
const kubeClusterCIDR = "10.244.0.0/16"

// kubeCluster is a Kubernetes control plane (API server and controller
// manager, scripts/kube-controlplane.sh) in a lab's switch namespace, on
// the underlay's switch address, where every lab host reaches it.
type kubeCluster struct {
	t    testing.TB
	bin  string // skiff-kube
	dir  string
	lab  *Lab
	addr string // the API server's URL
	// cniTimes, when set before the nodes start, is the file their CNI
	// plugins' calls are timed into (linkPlugin).
	cniTimes string
}

// startKube brings the control plane up in l's switch namespace and stops
// it when the test ends. The cluster cannot be built without skiff-kube
// (make deps builds it): the test fails then, it does not skip.
func startKube(t testing.TB, ctx context.Context, l *Lab) (*kubeCluster, error) {
	binDir := labtest.BinDir(t, "skiffd")
	k := &kubeCluster{t: t, bin: filepath.Join(binDir, "skiff-kube"), dir: filepath.Join(t.TempDir(), "kube"), lab: l,
		addr: "https://" + SwitchAddr().String() + ":16443"}
	if _, err := os.Stat(k.bin); err != nil {
		return nil, fmt.Errorf("no Kubernetes binaries (%v): make deps builds them (scripts/kube-build.sh)", err)
	}
	script, _ := filepath.Abs(filepath.Join("..", "scripts", "kube-controlplane.sh"))
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", l.SwitchNetns(), script, "up", k.dir)
	cmd.Env = append(os.Environ(), "SKIFF_KUBE="+k.bin, "SKIFF_BIN="+binDir, "SKIFF_KUBE_BIND="+SwitchAddr().String(),
		"SKIFF_KUBE_SCHEDULER=0", "SKIFF_KUBE_CLUSTER_CIDR="+kubeClusterCIDR, "SKIFF_KUBE_NODE_CIDR_MASK=24")
	t.Cleanup(func() {
		if out, err := exec.Command(script, "down", k.dir).CombinedOutput(); err != nil {
			t.Errorf("control plane down: %v: %s", err, out)
		}
	})
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("control plane up: %v: %s", err, out)
	} else {
		t.Logf("%s", out)
	}
	return k, nil
}

// kubectl runs kubectl as the cluster's administrator, with stdin.
func (k *kubeCluster) kubectl(stdin string, args ...string) (string, error) {
	cmd := exec.Command("ip", append([]string{"netns", "exec", k.lab.SwitchNetns(), k.bin, "kubectl",
		"--kubeconfig", filepath.Join(k.dir, "admin.kubeconfig")}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out)), nil
}

// must is kubectl that fails the test.
func (k *kubeCluster) must(stdin string, args ...string) string {
	k.t.Helper()
	out, err := k.kubectl(stdin, args...)
	if err != nil {
		k.t.Fatal(err)
	}
	return out
}

// serviceAccountConfig writes a kubeconfig with a token of skiff's service
// account (the manifest's), so that an agent has its RBAC and nothing more.
func (k *kubeCluster) serviceAccountConfig(path string) error {
	token, err := k.kubectl("", "create", "token", "skiff", "-n", "skiff-system", "--duration", "2h")
	if err != nil {
		return err
	}
	ca, err := os.ReadFile(filepath.Join(k.dir, "pki", "ca.crt"))
	if err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: lab
  cluster: {server: %q, certificate-authority-data: %s}
users:
- name: skiff
  user: {token: %q}
contexts:
- name: lab
  context: {cluster: lab, user: skiff}
current-context: lab
`, k.addr, base64.StdEncoding.EncodeToString(ca), token)
	return os.WriteFile(path, []byte(cfg), 0o600)
}

// node is a Node as the kubelet of a lab host registers it: its name and
// its underlay address as InternalIP.
func node(name string, ip netip.Addr) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Node
metadata: {name: %s}
status:
  addresses: [{type: InternalIP, address: %s}]
`, name, ip)
}

// pod is a pod bound to a node with the address a lab container has, as
// the kubelet would report it once its sandbox runs.
func (k *kubeCluster) pod(namespace, name, node string, ip netip.Addr, labels string) {
	k.t.Helper()
	spec := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {namespace: %s, name: %s, labels: {%s}}
spec:
  nodeName: %s
  containers: [{name: c, image: skiff.dev/busybox:1.35.0, ports: [{name: echo, containerPort: %d}]}]
`, namespace, name, labels, node, echoPort)
	// A new namespace's default service account comes a moment later
	// (the controller manager makes it); pods wait for it.
	if _, err := eventually(10*time.Second, func() error { _, err := k.kubectl(spec, "apply", "-f", "-"); return err }); err != nil {
		k.t.Fatal(err)
	}
	k.must("", "patch", "pod", name, "-n", namespace, "--subresource=status", "--type=merge", "-p",
		fmt.Sprintf(`{"status":{"phase":"Running","podIP":%q,"podIPs":[{"ip":%q}]}}`, ip, ip))
}

// TestKubeControlPlane: skiffd --kubernetes on two lab hosts against a real
// API server and controller manager (no kubelet: the Nodes and pods are
// made by hand, as the kubelet would report them), the agents holding only
// the manifest's RBAC (a token of its service account). The manifest is
// accepted by the API server; each host's subnet is its Node's podCIDR and
// the Node gets skiff's annotations; containers on both hosts reach each
// other; the other host's pods (and only pods) become the cache's
// endpoints; a NetworkPolicy selecting a pod denies what it does not allow,
// by a named port and a pod selector, and ends a running connection it
// denies; an egress policy allows by namespace selector and by an ipBlock
// with an exception; deleting them lifts the deny.
func TestKubeControlPlane(t *testing.T) {
	l, k := kubeLab(t, "tkube", "auto", 2)
	ctx := context.Background()
	for _, h := range l.Hosts {
		cidr := k.must("", "get", "node", h.Name, "-o", "jsonpath={.spec.podCIDR}")
		st, err := agentOf(t, l, h.Name).Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Host.Subnet.String() != cidr {
			t.Errorf("%s: subnet %s, the Node's podCIDR %q", h.Name, st.Host.Subnet, cidr)
		}
		if mac := k.must("", "get", "node", h.Name, "-o", `jsonpath={.metadata.annotations.skiff\.dev/vtep-mac}`); mac != st.Host.VTEPMAC {
			t.Errorf("%s: annotation vtep-mac %q, want %q", h.Name, mac, st.Host.VTEPMAC)
		}
		for _, c := range l.Containers {
			if ip, _ := l.IP(c.Name); c.Host == h.Name && !st.Host.Subnet.Contains(ip) {
				t.Errorf("%s has %s, outside its host's podCIDR %s", c.Name, ip, cidr)
			}
		}
	}
	if out := k.must("", "get", "configmap", "skiff-cluster", "-n", "skiff-system", "-o", "jsonpath={.data.cluster\\.json}"); !strings.Contains(out, "10.244.0.0/16") {
		t.Errorf("the cluster's configuration: %q", out)
	}

	// Pods: h1/c1 is a web pod, h2/c1 a db pod; h1/c2 and h2/c2 are no pods.
	echoServer(t, l, "h2/c1", echoPort)
	db, _ := l.IP("h2/c1")
	dbAddr := netip.AddrPortFrom(db, echoPort)
	if _, err := eventually(converges, func() error { return exchange(l, "h1/c2", "tcp4", dbAddr) }); err != nil {
		t.Fatalf("h1/c2 → h2/c1 before any pod: %v", err)
	}
	k.must("apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, labels: {team: shop}}\n", "apply", "-f", "-")
	web, _ := l.IP("h1/c1")
	k.pod("shop", "web", "h1", web, "app: web")
	k.pod("shop", "db", "h2", db, "app: db")
	other, _ := l.IP("h2/c2")
	if _, err := eventually(converges, func() error {
		var ips []netip.Addr
		for _, x := range cacheEntries(t, l, "h1").EgressIPs {
			ips = append(ips, x.Container)
		}
		if !slices.Contains(ips, db) {
			return fmt.Errorf("h1's cache has no entry for the db pod %s: %v", db, ips)
		}
		if slices.Contains(ips, other) {
			return fmt.Errorf("h1's cache has an entry for %s, which is no pod", other)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}

	policy := `apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: shop, name: db}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: web}}}]
    ports: [{port: echo}]
`
	// A connection that runs when the policy comes, and that it denies.
	live := startStream(t, l, "h1/c2", "h2/c1", 7001)
	defer live.finish()
	if err := live.progresses(time.Second); err != nil {
		t.Fatal(err)
	}
	k.must(policy, "apply", "-f", "-")
	start := time.Now()
	if _, err := eventually(converges, func() error {
		if err := exchange(l, "h1/c2", "tcp4", dbAddr); err == nil {
			return fmt.Errorf("h1/c2, no pod, still reaches the db pod")
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	t.Logf("the policy denied within %v", time.Since(start).Round(10*time.Millisecond))
	if err := exchange(l, "h1/c1", "tcp4", dbAddr); err != nil {
		t.Errorf("the web pod, allowed by the policy: %v", err)
	}
	if _, err := live.stops(converges, 500*time.Millisecond); err != nil {
		t.Error("the connection the policy denies still moves")
	} else {
		t.Logf("the running connection moved no byte for 0.5 s, %v after the policy was applied", time.Since(start).Round(10*time.Millisecond))
	}

	// The web pod's egress: to pods of namespaces labelled team=shop, and
	// to the cluster's range but h2/c2 on port 7000.
	echoServer(t, l, "h1/c2", echoPort)
	echoServer(t, l, "h2/c2", echoPort)
	near, _ := l.IP("h1/c2")
	if _, err := eventually(converges, func() error { return exchange(l, "h1/c1", "tcp4", netip.AddrPortFrom(other, echoPort)) }); err != nil {
		t.Fatalf("the web pod to %s before its egress policy: %v", other, err)
	}
	k.must(fmt.Sprintf(`apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: shop, name: web-out}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{namespaceSelector: {matchLabels: {team: shop}}}]
  - to: [{ipBlock: {cidr: 10.244.0.0/16, except: [%s/32]}}]
    ports: [{port: %d}]
`, other, echoPort), "apply", "-f", "-")
	if _, err := eventually(converges, func() error {
		if err := exchange(l, "h1/c1", "tcp4", netip.AddrPortFrom(other, echoPort)); err == nil {
			return fmt.Errorf("the web pod still reaches %s, its ipBlock's exception", other)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	for _, to := range []netip.AddrPort{dbAddr, netip.AddrPortFrom(near, echoPort)} {
		if err := exchange(l, "h1/c1", "tcp4", to); err != nil {
			t.Errorf("the web pod to %s, allowed by its egress: %v", to, err)
		}
	}
	k.must("", "delete", "networkpolicy", "db", "web-out", "-n", "shop")
	if _, err := eventually(converges, func() error { return exchange(l, "h1/c2", "tcp4", dbAddr) }); err != nil {
		t.Errorf("after the policy went: %v", err)
	}
}
