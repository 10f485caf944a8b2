package lab

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/sockets"
)

// kubeLab is a lab whose agents run skiffd --kubernetes against a control
// plane in the switch's namespace (the manifest applied, each agent with
// the token of skiff's service account), its hosts registered as Nodes
// before their agents start, as a kubelet would have.
func kubeLab(t testing.TB, name, mode string, containersPerHost int) (*Lab, *kubeCluster) {
	agentCfg := filepath.Join(t.TempDir(), "agent.kubeconfig")
	var k *kubeCluster
	l := newLab(t, Config{Name: name, Hosts: 2, ContainersPerHost: containersPerHost, Mode: mode,
		AgentArgs: []string{"--kubernetes", "--kubeconfig", agentCfg},
		Prepare: func(ctx context.Context, l *Lab) (err error) {
			if k, err = startKube(t, ctx, l); err != nil {
				return err
			}
			manifest, _ := filepath.Abs(filepath.Join("..", "deploy", "kubernetes", "skiff.yaml"))
			// The manifest as it is (a server dry run cannot take it on a
			// new cluster: its namespace does not exist yet).
			if _, err := k.kubectl("", "apply", "-f", manifest); err != nil {
				return fmt.Errorf("the manifest: %w", err)
			}
			if err := k.serviceAccountConfig(agentCfg); err != nil {
				return err
			}
			for i := 1; i <= l.Config.Hosts; i++ {
				ip := underlayNet.Addr().As4()
				ip[3] = byte(i)
				if _, err := k.kubectl(node(fmt.Sprintf("h%d", i), netip.AddrFrom4(ip)), "apply", "-f", "-"); err != nil {
					return err
				}
			}
			return nil
		}})
	return l, k
}

// kubeNode is a lab host run as a Kubernetes node: Debian's containerd with
// its CRI plugin (skiff-cni from the lab's conflist for the host), a
// kubelet and kube-proxy in iptables mode, all in the host's network
// namespace, each with directories, cgroups and a socket of its own.
type kubeNode struct {
	k      *kubeCluster
	name   string
	dir    string
	netns  string
	cgroup string // the kubelet's cgroupRoot
	procs  []*exec.Cmd
}

// kernelTunables are the sysctls the kubelet sets host-wide at start
// (pkg/kubelet/cm.setupKernelTunables): they are not per network
// namespace, so the test puts the machine's values back when it ends.
var kernelTunables = []string{"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes"}

// startNodes makes every lab host a node and waits until each is Ready.
func (k *kubeCluster) startNodes(ctx context.Context) []*kubeNode {
	t := k.t
	saved := map[string][]byte{}
	for _, s := range kernelTunables {
		if b, err := os.ReadFile("/proc/sys/" + s); err == nil {
			saved[s] = b
		}
	}
	t.Cleanup(func() {
		for s, b := range saved {
			if err := os.WriteFile("/proc/sys/"+s, b, 0o644); err != nil {
				t.Errorf("restoring %s: %v", s, err)
			}
		}
	})
	// Pods first (their sandboxes' CNI DEL needs containerd and the
	// agent), then the processes, then what they leave.
	var nodes []*kubeNode
	before := podNetns()
	t.Cleanup(func() { k.stopNodes(nodes, before) })
	for _, h := range k.lab.Hosts {
		n, err := k.startNode(ctx, h.Name)
		if n != nil {
			nodes = append(nodes, n)
		}
		if err != nil {
			t.Fatalf("node %s: %v", h.Name, err)
		}
	}
	for _, n := range nodes {
		if _, err := k.kubectl("", "wait", "--for=condition=Ready", "node/"+n.name, "--timeout=120s"); err != nil {
			t.Fatalf("%v\n%s", err, n.logs())
		}
	}
	return nodes
}

func (k *kubeCluster) startNode(ctx context.Context, host string) (*kubeNode, error) {
	t := k.t
	h, err := k.lab.Host(host)
	if err != nil {
		return nil, err
	}
	ns, err := k.lab.Netns(host)
	if err != nil {
		return nil, err
	}
	n := &kubeNode{k: k, name: host, dir: filepath.Join(t.TempDir(), host), netns: NetnsPath(ns),
		cgroup: "/skiff-" + k.lab.Config.Name + "-" + host}

	cniBin, cniConf := filepath.Join(n.dir, "cni", "bin"), filepath.Join(n.dir, "cni", "net.d")
	for _, d := range []string{cniBin, cniConf, filepath.Join(n.dir, "kubelet"), filepath.Join(n.dir, "pod-logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return n, err
		}
	}
	// The CRI runs loopback in every sandbox; skiff-cni and portmap from
	// the lab's conflist.
	links := map[string]string{"skiff-cni": filepath.Join(k.lab.Config.BinDir, "skiff-cni")}
	for _, p := range []string{"loopback", "portmap"} {
		if d := pluginDir(p); d != "" {
			links[p] = filepath.Join(d, p)
		} else if p == "loopback" {
			return n, errors.New("no loopback CNI plugin (make deps installs containernetworking-plugins)")
		}
	}
	for name, target := range links {
		if err := k.linkPlugin(filepath.Join(cniBin, name), target, host); err != nil {
			return n, err
		}
	}
	list, err := k.lab.ConfList(host)
	if err != nil {
		return n, err
	}
	if err := os.WriteFile(filepath.Join(cniConf, "10-skiff.conflist"), list, 0o644); err != nil {
		return n, err
	}

	sock := filepath.Join(n.dir, "ctd.sock")
	ctd := fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
[grpc]
  address = %[3]q
[ttrpc]
  address = "%[3]s.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = %[4]q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.6"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %[5]q
    conf_dir = %[6]q
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      Root = %[7]q
`, filepath.Join(n.dir, "root"), filepath.Join(n.dir, "state"), sock, filepath.Join(n.dir, "opt"), cniBin, cniConf,
		filepath.Join(n.dir, "runc"))
	if err := os.WriteFile(filepath.Join(n.dir, "containerd.toml"), []byte(ctd), 0o644); err != nil {
		return n, err
	}
	if err := n.start("containerd", "containerd", "--config", filepath.Join(n.dir, "containerd.toml")); err != nil {
		return n, err
	}
	if _, err := eventually(20*time.Second, func() error {
		return exec.Command("ctr", "-a", sock, "version").Run()
	}); err != nil {
		return n, fmt.Errorf("containerd did not answer: %v\n%s", err, n.logs())
	}
	script, _ := filepath.Abs(filepath.Join("..", "scripts", "kube-images.sh"))
	if out, err := exec.CommandContext(ctx, script, "--import", sock).CombinedOutput(); err != nil {
		return n, fmt.Errorf("images: %v: %s", err, out)
	}

	pki := filepath.Join(k.dir, "pki")
	admin := filepath.Join(k.dir, "admin.kubeconfig")
	kubelet := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %[1]s
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
containerRuntimeEndpoint: unix://%[2]s
cgroupDriver: cgroupfs
cgroupRoot: %[3]s
failSwapOn: false
oomScoreAdj: 0
podLogsDir: %[4]s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %[5]s}
authorization: {mode: AlwaysAllow}
evictionHard: {memory.available: 100Mi, nodefs.available: 1%%, imagefs.available: 1%%, nodefs.inodesFree: 1%%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
`, h.UnderlayIP, sock, n.cgroup, filepath.Join(n.dir, "pod-logs"), filepath.Join(pki, "ca.crt"))
	if err := os.WriteFile(filepath.Join(n.dir, "kubelet.yaml"), []byte(kubelet), 0o644); err != nil {
		return n, err
	}
	// The kubelet wants its cgroupRoot in every hierarchy.
	hierarchies, _ := filepath.Glob("/sys/fs/cgroup/*/cgroup.procs")
	for _, h := range hierarchies {
		if err := os.Mkdir(filepath.Dir(h)+n.cgroup, 0o755); err != nil {
			return n, fmt.Errorf("cgroup root: %w", err)
		}
	}
	// skiff's seccomp profile as the Localhost profile skiff.json (the
	// kubelet's seccomp directory), handing listeners to this host's agent.
	profile, err := exec.Command(filepath.Join(k.lab.Config.BinDir, "skiff"), "seccomp-profile", "--listener", k.lab.SeccompSocket(host)).Output()
	if err != nil {
		return n, fmt.Errorf("skiff seccomp-profile: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(n.dir, "kubelet", "seccomp"), 0o755); err != nil {
		return n, err
	}
	if err := os.WriteFile(filepath.Join(n.dir, "kubelet", "seccomp", "skiff.json"), profile, 0o644); err != nil {
		return n, err
	}
	if err := n.start("kubelet", k.bin, "kubelet", "--config", filepath.Join(n.dir, "kubelet.yaml"),
		"--kubeconfig", admin, "--root-dir", filepath.Join(n.dir, "kubelet"), "--hostname-override", host,
		"--node-ip", h.UnderlayIP.String()); err != nil {
		return n, err
	}
	if err := n.start("kube-proxy", k.bin, "proxy", "--kubeconfig", admin, "--hostname-override", host,
		"--proxy-mode", "iptables", "--cluster-cidr", kubeClusterCIDR, "--conntrack-max-per-core", "0",
		"--oom-score-adj", "0", "--metrics-bind-address", "127.0.0.1:10249", "--healthz-bind-address", "127.0.0.1:10256"); err != nil {
		return n, err
	}
	return n, nil
}

// linkPlugin puts a CNI plugin into a node's plugin directory: a link,
// or with k.cniTimes a script that runs it and appends one line per call
// to that file (host, plugin, command, container, start and end in ns
// since the epoch, exit status). The script's own cost is one date(1)
// process inside the timed span.
func (k *kubeCluster) linkPlugin(path, target, host string) error {
	if k.cniTimes == "" || filepath.Base(path) == "loopback" {
		return os.Symlink(target, path)
	}
	script := fmt.Sprintf(`#!/bin/sh
start=$(date +%%s%%N)
%q
rc=$?
echo "%s %s $CNI_COMMAND $CNI_CONTAINERID $start $(date +%%s%%N) $rc" >>%q
exit $rc
`, target, host, filepath.Base(path), k.cniTimes)
	return os.WriteFile(path, []byte(script), 0o755)
}

// start runs a node's process in the host's network namespace (nsenter:
// the machine's mount namespace, where the CRI's pod namespaces are),
// logging to DIR/NAME.log.
func (n *kubeNode) start(name, bin string, args ...string) error {
	log, err := os.Create(filepath.Join(n.dir, name+".log"))
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command("nsenter", append([]string{"--net=" + n.netns, "--", bin}, args...)...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	n.procs = append(n.procs, cmd)
	return nil
}

// logs is the tail of each process's log, for a failure.
func (n *kubeNode) logs() string {
	var b strings.Builder
	for _, name := range []string{"containerd", "kubelet", "kube-proxy"} {
		out, _ := os.ReadFile(filepath.Join(n.dir, name+".log"))
		fmt.Fprintf(&b, "--- %s %s ---\n%s\n", n.name, name, tail(out, 3000))
	}
	return b.String()
}

// stopNodes deletes every pod (the kubelets stop their sandboxes: CNI
// DEL, and the CRI removes the pod's network namespace), then stops each
// node, and removes what outlived them: pod namespaces (an error: a
// sandbox that was not stopped), containerd shims, the kubelets' cgroups.
func (k *kubeCluster) stopNodes(nodes []*kubeNode, before []string) {
	t := k.t
	if _, err := k.kubectl("", "delete", "pods", "--all-namespaces", "--all", "--wait=true", "--timeout=60s"); err != nil {
		t.Errorf("deleting the pods: %v", err)
	}
	left := func() (l []string) {
		for _, ns := range podNetns() {
			if !slices.Contains(before, ns) {
				l = append(l, ns)
			}
		}
		return l
	}
	if _, err := eventually(20*time.Second, func() error {
		if l := left(); len(l) > 0 {
			return fmt.Errorf("pod namespaces %v", l)
		}
		return nil
	}); err != nil {
		t.Logf("after every pod was deleted: %v", err)
	}
	for _, n := range slices.Backward(nodes) {
		n.stop()
	}
	for _, ns := range left() {
		t.Errorf("pod namespace %s outlived its pod; removing it", ns)
		syscall.Unmount(ns, syscall.MNT_DETACH)
		os.Remove(ns)
	}
}

// podNetns lists the CRI's pod network namespaces.
func podNetns() []string {
	m, _ := filepath.Glob("/run/netns/cni-*")
	return m
}

// stop stops the node's processes in reverse order, the containerd shims
// its containerd started (their command line names its socket), and
// removes the kubelet's cgroups and the mounts left under its directory.
func (n *kubeNode) stop() {
	t := n.k.t
	for _, p := range slices.Backward(n.procs) {
		p.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { p.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
	sock := filepath.Join(n.dir, "ctd.sock")
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, f := range procs {
		if b, err := os.ReadFile(f); err == nil && strings.Contains(string(b), "containerd-shim") && strings.Contains(string(b), sock) {
			var pid int
			fmt.Sscanf(strings.TrimPrefix(f, "/proc/"), "%d", &pid)
			t.Logf("%s: stopping containerd shim %d that outlived its pods", n.name, pid)
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	// Every hierarchy's (v1 and the v2 one): innermost directories first,
	// once the processes left in them (pods' the kubelet did not stop, and
	// which outlive the killed shims) are gone.
	roots, _ := filepath.Glob("/sys/fs/cgroup/*" + n.cgroup)
	var dirs []string
	for _, root := range roots {
		filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
	}
	left := func() (pids []int) {
		for _, d := range dirs {
			b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, f := range strings.Fields(string(b)) {
				var pid int
				if _, err := fmt.Sscanf(f, "%d", &pid); err == nil && !slices.Contains(pids, pid) {
					pids = append(pids, pid)
				}
			}
		}
		return pids
	}
	if pids := left(); len(pids) > 0 {
		t.Errorf("%s: processes %v outlived their pods; killing them", n.name, pids)
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		eventually(5*time.Second, func() error {
			if pids := left(); len(pids) > 0 {
				return fmt.Errorf("%v", pids)
			}
			return nil
		})
	}
	for _, d := range slices.Backward(dirs) {
		if err := os.Remove(d); err != nil {
			t.Errorf("%s: cgroup %s: %v", n.name, d, err)
		}
	}
	// Snapshots the shims left mounted.
	if out, err := exec.Command("sh", "-c", "grep -o ' "+n.dir+"[^ ]*' /proc/self/mounts | sort -r | xargs -r -n1 umount -l").CombinedOutput(); err != nil {
		t.Logf("%s: unmounting: %v: %s", n.name, err, out)
	}
}

// runPod starts a busybox pod on node running sh -c cmd, waits until it is
// Ready, and returns its address. With hostSockets the pod runs under
// skiff's seccomp profile (Localhost skiff.json): its TCP takes host
// sockets where the layer runs.
func (k *kubeCluster) runPod(namespace, name, node, labels, cmd string, hostSockets bool) netip.Addr {
	k.t.Helper()
	security := ""
	if hostSockets {
		security = "\n  securityContext: {seccompProfile: {type: Localhost, localhostProfile: skiff.json}}"
	}
	spec := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {namespace: %s, name: %s, labels: {%s}}
spec:
  nodeName: %s
  terminationGracePeriodSeconds: 1%s
  containers:
  - name: c
    image: skiff.dev/busybox:1.35.0
    command: [sh, -c, %q]
    ports: [{name: http, containerPort: 8080}]
`, namespace, name, labels, node, security, cmd)
	if _, err := eventually(10*time.Second, func() error { _, err := k.kubectl(spec, "apply", "-f", "-"); return err }); err != nil {
		k.t.Fatal(err)
	}
	if _, err := k.kubectl("", "wait", "--for=condition=Ready", "pod/"+name, "-n", namespace, "--timeout=90s"); err != nil {
		desc, _ := k.kubectl("", "describe", "pod", name, "-n", namespace)
		k.t.Fatalf("%v\n%s", err, desc)
	}
	ip, err := netip.ParseAddr(k.must("", "get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.podIP}"))
	if err != nil {
		k.t.Fatalf("pod %s: %v", name, err)
	}
	return ip
}

// podEndpoint is the endpoint host's agent holds for a pod, or nil.
func podEndpoint(t testing.TB, l *Lab, host, namespace, name string) *api.EndpointStatus {
	t.Helper()
	eps, err := agentOf(t, l, host).Endpoints(context.Background(), false)
	if err != nil {
		t.Fatal(err)
	}
	for i := range eps {
		if p := eps[i].Pod; p != nil && p.Namespace == namespace && p.Name == name {
			return &eps[i]
		}
	}
	return nil
}

// webServer serves "skiff-POD" over HTTP on port 8080 in a busybox pod.
// (busybox 1.35's wget crashes with -T: the tests wrap it in timeout.)
const webServer = "mkdir -p /www && echo skiff-$(hostname) >/www/index.html && exec httpd -f -p 0.0.0.0:8080 -h /www"

// TestKubePods: each lab host is a node with containerd's CRI, a kubelet
// and kube-proxy; skiffd --kubernetes is their network. Pods get
// addresses of their node's podCIDR through skiff-cni, recorded with the
// pod's name; they reach each other over TCP (kubectl exec: busybox wget),
// UDP and ICMP, on one host and across hosts; kubectl logs and exec work
// (the API server reaches the kubelets over the underlay); a deleted pod's
// endpoint is released by the CRI's DEL.
func TestKubePods(t *testing.T) {
	l, k := kubeLab(t, "tkpod", "auto", 0)
	ctx := context.Background()
	k.startNodes(ctx)

	pods := map[string]string{"a": "h1", "b": "h2", "c": "h1"}
	ips := map[string]netip.Addr{}
	for _, name := range []string{"a", "b", "c"} {
		ips[name] = k.runPod("default", name, pods[name], "app: "+name, webServer, false)
	}
	for name, host := range pods {
		cidr := netip.MustParsePrefix(k.must("", "get", "node", host, "-o", "jsonpath={.spec.podCIDR}"))
		if !cidr.Contains(ips[name]) {
			t.Errorf("pod %s on %s has %s, outside the node's podCIDR %s", name, host, ips[name], cidr)
		}
		ep := podEndpoint(t, l, host, "default", name)
		if ep == nil || ep.IP.Addr() != ips[name] {
			t.Errorf("pod %s (%s): %s's agent holds %+v", name, ips[name], host, ep)
		} else {
			var on []string
			for _, l := range ep.Layers {
				if l.On {
					on = append(on, l.Name)
				}
			}
			t.Logf("pod %s on %s: %s, on %v", name, host, ips[name], on)
		}
	}

	for _, to := range []string{"b", "c"} {
		url := fmt.Sprintf("http://%s:8080/", ips[to])
		if out, err := k.kubectl("", "exec", "a", "--", "timeout", "5", "wget", "-q", "-O", "-", url); err != nil || out != "skiff-"+to {
			t.Errorf("a → %s over TCP: %q %v", to, out, err)
		}
		if out, err := k.kubectl("", "exec", "a", "--", "ping", "-c", "1", "-W", "2", ips[to].String()); err != nil {
			t.Errorf("a → %s over ICMP: %v %s", to, err, out)
		}
	}
	// UDP (busybox has no UDP server): sockets opened in the pods'
	// namespaces, which the agents recorded.
	nsOf := func(host, name string) string {
		ep := podEndpoint(t, l, host, "default", name)
		if ep == nil {
			t.Fatalf("no endpoint for pod %s", name)
		}
		return filepath.Base(ep.Netns)
	}
	for _, to := range []string{"b", "c"} {
		var srv net.PacketConn
		if err := inNetns(nsOf(pods[to], to), func() (err error) { srv, err = net.ListenPacket("udp4", ":9000"); return err }); err != nil {
			t.Fatal(err)
		}
		go echoUDP(srv)
		err := inNetns(nsOf("h1", "a"), func() error {
			c, err := net.Dial("udp4", netip.AddrPortFrom(ips[to], 9000).String())
			if err != nil {
				return err
			}
			defer c.Close()
			buf := make([]byte, 64)
			for i := 0; i < 20; i++ {
				msg := fmt.Sprintf("datagram %d to %s", i, to)
				c.SetDeadline(time.Now().Add(2 * time.Second))
				if _, err := c.Write([]byte(msg)); err != nil {
					return err
				}
				n, err := c.Read(buf)
				if err != nil || string(buf[:n]) != msg {
					return fmt.Errorf("datagram %d: %q %v", i, buf[:n], err)
				}
			}
			return nil
		})
		srv.Close()
		if err != nil {
			t.Errorf("a → %s over UDP: %v", to, err)
		}
	}
	if out := k.must("", "logs", "b"); out != "" {
		t.Logf("logs of b: %q", out)
	}
	k.must("", "exec", "b", "--", "sh", "-c", "echo hello-from-b-log >/proc/1/fd/1")
	if _, err := eventually(10*time.Second, func() error {
		if out, _ := k.kubectl("", "logs", "b"); !strings.Contains(out, "hello-from-b-log") {
			return fmt.Errorf("kubectl logs b: %q", out)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}

	// Deleting c: the CRI's DEL releases its endpoint.
	k.must("", "delete", "pod", "c", "--wait=true", "--timeout=60s")
	if _, err := eventually(converges, func() error {
		if ep := podEndpoint(t, l, "h1", "default", "c"); ep != nil {
			return fmt.Errorf("h1 still holds the deleted pod c: %+v", ep.Endpoint)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
}

// services are a ClusterIP and a NodePort Service in front of the pods
// labelled tier=web, port 80 to their 8080.
const services = `apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {tier: web}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: web-np}
spec:
  type: NodePort
  selector: {tier: web}
  ports: [{port: 80, targetPort: 8080}]
`

// fetches has pod fetch url n times with busybox wget (a connection
// each) and returns how many answers each server gave; "FAIL" counts
// the failed fetches.
func (k *kubeCluster) fetches(pod, url string, n int) (map[string]int, error) {
	script := fmt.Sprintf(`i=0; while [ $i -lt %d ]; do timeout 3 wget -q -O - %s || echo FAIL; i=$((i+1)); done`, n, url)
	out, err := k.kubectl("", "exec", pod, "--", "sh", "-c", script)
	if err != nil {
		return nil, err
	}
	got := map[string]int{}
	for _, line := range strings.Fields(out) {
		got[line]++
	}
	return got, nil
}

// TestKubeServices: Services through kube-proxy (iptables mode) on every
// layer: pod a (h1) reaches a ClusterIP Service whose endpoints are a pod
// on its own host and one on the other, 1 000 connections without a
// failure, answered by both; the NodePort on each node's address; each
// backend by its own address; and the ClusterIP from two pods of the
// other node, one of them a backend (hairpin). The overlay and the cache carry plain
// pods; in sockets and auto mode every pod runs under skiff's seccomp
// profile (containerd 1.6 passes no cgroupPath: the agent learns each
// pod's cgroup from the runtime's hand-off), so the backends listen on
// host sockets, which the Service connections reach through the DNAT, and
// a's connections to the pods' addresses are host sockets (in auto, the
// ones on its own host stay out of channels: the seccomp agent's host
// sockets opt out, docs/channels.md). A connection to a Service's virtual
// address stays the pod's own socket (docs/kubernetes.md).
func TestKubeServices(t *testing.T) {
	for _, mode := range []string{"overlay", "cache", "sockets", "auto"} {
		t.Run(mode, func(t *testing.T) {
			l, k := kubeLab(t, "tksvc", mode, 0)
			ctx := context.Background()
			k.startNodes(ctx)
			hostSockets := mode == "sockets" || mode == "auto"
			pods := map[string]string{"a": "h1", "b": "h2", "c": "h1"}
			k.runPod("default", "a", "h1", "app: a", "exec sleep 3600", hostSockets)
			k.runPod("default", "b", "h2", "app: b, tier: web", webServer, hostSockets)
			k.runPod("default", "c", "h1", "app: c, tier: web", webServer, hostSockets)
			k.must(services, "apply", "-f", "-")
			vip := k.must("", "get", "service", "web", "-o", "jsonpath={.spec.clusterIP}")
			port := k.must("", "get", "service", "web-np", "-o", "jsonpath={.spec.ports[0].nodePort}")
			for name, host := range pods {
				e := podEndpoint(t, l, host, "default", name)
				if e == nil {
					t.Fatalf("no endpoint for pod %s", name)
				}
				if on, why := layerOn(e, "sockets"); on != hostSockets {
					var pid int
					if i := strings.Index(why, "pid "); i >= 0 {
						fmt.Sscanf(why[i+4:], "%d", &pid)
					}
					cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
					status, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
					cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
					t.Errorf("pod %s: sockets layer on %v (%s), want %v; the process named: %q\n%s\n%s", name, on, why, hostSockets, cmdline, status, cg)
				}
			}
			// Each target and the pod that must answer it ("": b and c both).
			type target struct{ url, pod string }
			targets := []target{{"http://" + vip + "/", ""}}
			for _, h := range l.Hosts {
				targets = append(targets, target{fmt.Sprintf("http://%s:%s/", h.UnderlayIP, port), ""})
			}
			for _, name := range []string{"b", "c"} {
				ip := k.must("", "get", "pod", name, "-o", "jsonpath={.status.podIP}")
				targets = append(targets, target{"http://" + ip + ":8080/", name})
			}
			for i, tg := range targets {
				url := tg.url
				// kube-proxy programs the rules a moment after the
				// Service and its endpoints appear.
				if _, err := eventually(20*time.Second, func() error {
					got, err := k.fetches("a", url, 1)
					if err == nil && got["FAIL"] > 0 {
						err = fmt.Errorf("%s: %v", url, got)
					}
					return err
				}); err != nil {
					t.Fatalf("%v\n%s", err, k.must("", "get", "endpointslices", "-o", "wide"))
				}
				n := 1000
				if i > 0 {
					n = 200
				}
				before := seccompReplaced(t, l, "h1", "a")
				var optedOut uint64 // sockets the channels layer of a's host left out
				if mode == "auto" {
					optedOut = channelsStatus(t, l, "h1").Counters["opted_out"]
				}
				start := time.Now()
				got, err := k.fetches("a", url, n)
				if err != nil {
					t.Fatal(err)
				}
				replaced := seccompReplaced(t, l, "h1", "a") - before
				t.Logf("%s: %d fetches in %v: %v; %d on host sockets", url, n, time.Since(start).Round(time.Millisecond), got, replaced)
				if tg.pod != "" {
					// A pod's own address: a host socket where the
					// pods have them.
					want := "skiff-" + tg.pod
					if got["FAIL"] > 0 || got[want] != n {
						t.Errorf("%s: %v, want %d answers from %s", url, got, n, want)
					}
					if hostSockets && replaced < uint64(n) {
						t.Errorf("%s: %d of pod a's %d connections on host sockets", url, replaced, n)
					}
					// Both ends of a connection on a's own host are
					// the seccomp agent's: they stay out of channels.
					if mode == "auto" && pods[tg.pod] == "h1" {
						if out := channelsStatus(t, l, "h1").Counters["opted_out"] - optedOut; out < uint64(2*n) {
							t.Errorf("%s: %d sockets opted out of channels for %d connections on one host", url, out, n)
						}
					}
				} else if got["FAIL"] > 0 || got["skiff-b"]+got["skiff-c"] != n || got["skiff-b"] == 0 || got["skiff-c"] == 0 {
					t.Errorf("%s: %v, want %d answers from both skiff-b and skiff-c", url, got, n)
				}
			}
			// From the other node, through the ClusterIP: from d, and
			// from b, a backend itself (kube-proxy DNATs some of its
			// connections to its own address: the bridge's hairpin).
			k.runPod("default", "d", "h2", "app: d", "exec sleep 3600", hostSockets)
			for _, from := range []string{"d", "b"} {
				if got, err := k.fetches(from, targets[0].url, 200); err != nil || got["FAIL"] > 0 || got["skiff-b"]+got["skiff-c"] != 200 || got["skiff-b"] == 0 || got["skiff-c"] == 0 {
					t.Errorf("%s → %s: %v %v, want 200 answers from both", from, targets[0].url, got, err)
				}
			}
			// The servers' listeners are host sockets: every Service
			// connection above reached one through kube-proxy's DNAT.
			for _, name := range []string{"b", "c"} {
				if r := seccompReplaced(t, l, pods[name], name); hostSockets && r == 0 {
					t.Errorf("pod %s's listener is not a host socket", name)
				}
			}
		})
	}
}

// layerOn reports whether an endpoint takes layer name, and why not.
func layerOn(e *api.EndpointStatus, name string) (bool, string) {
	for _, l := range e.Layers {
		if l.Name == name {
			return l.On, l.Reason
		}
	}
	return false, "no such layer"
}

// seccompReplaced is how many connect and listen calls of a pod's
// processes its broker moved to host sockets (0 without the layer).
func seccompReplaced(t *testing.T, l *Lab, host, pod string) uint64 {
	t.Helper()
	e := podEndpoint(t, l, host, "default", pod)
	st, err := agentOf(t, l, host).Status(context.Background())
	if err != nil || e == nil {
		t.Fatalf("status of %s: %v", host, err)
	}
	s, err := sockets.StatusOf(st)
	if err != nil || s == nil {
		return 0
	}
	for _, c := range s.Containers {
		if c.ContainerID == e.ContainerID {
			return c.Seccomp.Replaced
		}
	}
	return 0
}

// nodeState is what a node's pods leave on its host, counted.
type nodeState struct {
	Endpoints, Records, Leases, Veths, CacheIngress, Brokers, Listeners int
}

// nodeStateOf counts host's endpoints (the agent's), its local records and
// address leases (files), the skiff veths in its namespace, the cache's
// ingress entries, the containers the sockets layer serves, and the
// listeners its HostListeners object publishes.
func (k *kubeCluster) nodeStateOf(host string) nodeState {
	t, l := k.t, k.lab
	t.Helper()
	var s nodeState
	eps, err := agentOf(t, l, host).Endpoints(context.Background(), false)
	if err != nil {
		t.Fatal(err)
	}
	s.Endpoints = len(eps)
	dir := filepath.Join(l.hostDir(host), "state", "local")
	recs, _ := os.ReadDir(filepath.Join(dir, "endpoints"))
	s.Records = len(recs)
	leases, _ := os.ReadDir(filepath.Join(dir, "leases"))
	for _, f := range leases {
		if f.Name() != "last" { // a hint, not a lease
			s.Leases++
		}
	}
	s.Veths = containerVeths(t, l, host)
	s.CacheIngress = len(cacheEntries(t, l, host).Ingress)
	if st := socketsStatus(t, l, host); st != nil {
		s.Brokers = len(st.Containers)
	}
	out, _ := k.kubectl("", "get", "hostlisteners", host, "-o", "jsonpath={.spec.listeners}")
	s.Listeners = strings.Count(out, ":")
	return s
}

// TestKubeChurn: 50 pods made and deleted on one node, ten at a time,
// under skiff's seccomp profile (host sockets, each a broker), one of
// every ten reaching a server pod on the other node and listening on a
// port of its own, leave the node as it was: the agent's endpoints, its
// local records and address leases, the host's veths, the cache's
// entries, the sockets layer's brokers and the node's published
// listeners. Then a deleted Node's podCIDR route goes from the other
// host, and its HostListeners object with it.
func TestKubeChurn(t *testing.T) {
	l, k := kubeLab(t, "tkchurn", "auto", 0)
	ctx := context.Background()
	k.startNodes(ctx)
	srv := k.runPod("default", "srv", "h2", "app: srv", webServer, true)
	before := k.nodeStateOf("h1")
	t.Logf("h1 before: %+v", before)
	start := time.Now()
	for round := 0; round < 5; round++ {
		var specs []string
		for i := 0; i < 10; i++ {
			cmd := "exec sleep 3600"
			if i == 0 {
				cmd = "exec httpd -f -p 0.0.0.0:7000 -h /"
			}
			specs = append(specs, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: churn%d, labels: {app: churn}}
spec:
  nodeName: h1
  terminationGracePeriodSeconds: 1
  securityContext: {seccompProfile: {type: Localhost, localhostProfile: skiff.json}}
  containers: [{name: c, image: skiff.dev/busybox:1.35.0, command: [sh, -c, %q]}]
`, round*10+i, cmd))
		}
		k.must(strings.Join(specs, "---\n"), "apply", "-f", "-")
		if _, err := k.kubectl("", "wait", "--for=condition=Ready", "pod", "-l", "app=churn", "--timeout=90s"); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		first := fmt.Sprintf("churn%d", round*10)
		url := fmt.Sprintf("http://%s:8080/", srv)
		if out, err := k.kubectl("", "exec", first, "--", "timeout", "5", "wget", "-q", "-O", "-", url); err != nil || out != "skiff-srv" {
			t.Errorf("%s → srv: %q %v", first, out, err)
		}
		if _, err := eventually(converges, func() error {
			if n := k.nodeStateOf("h1").Listeners; n <= before.Listeners {
				return fmt.Errorf("h1 publishes %d listeners", n)
			}
			return nil
		}); err != nil {
			t.Errorf("%s's listener on a host socket: %v", first, err)
		}
		k.must("", "delete", "pods", "-l", "app=churn", "--wait=true", "--timeout=90s")
	}
	t.Logf("50 pods made and deleted in %v", time.Since(start).Round(time.Millisecond))
	if _, err := eventually(converges, func() error {
		if now := k.nodeStateOf("h1"); now != before {
			return fmt.Errorf("h1 after: %+v, before: %+v", now, before)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}

	// h2's Node goes: h1 forgets the route to its podCIDR.
	cidr := netip.MustParsePrefix(k.must("", "get", "node", "h2", "-o", "jsonpath={.spec.podCIDR}"))
	routed := func() bool {
		var found bool
		l.Do("h1", func() error {
			routes, err := netlink.RouteList(nil, netlink.FAMILY_V4)
			for _, r := range routes {
				if r.Dst != nil && r.Dst.String() == cidr.String() {
					found = true
				}
			}
			return err
		})
		return found
	}
	if !routed() {
		t.Fatalf("h1 has no route to h2's podCIDR %s", cidr)
	}
	k.must("", "delete", "node", "h2", "--wait=true", "--timeout=30s")
	if _, err := eventually(converges, func() error {
		if routed() {
			return fmt.Errorf("h1 still routes h2's podCIDR %s", cidr)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	if _, err := eventually(30*time.Second, func() error {
		if out, err := k.kubectl("", "get", "hostlisteners", "h2"); err == nil {
			return fmt.Errorf("h2's HostListeners outlived its Node: %s", out)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
}

// reaches fetches http://ip:port/ once from pod (namespace/name) and
// returns what answered.
func (k *kubeCluster) reaches(pod string, ip netip.Addr, port int) (string, error) {
	ns, name, _ := strings.Cut(pod, "/")
	return k.kubectl("", "exec", "-n", ns, name, "--", "timeout", "3", "wget", "-q", "-O", "-", fmt.Sprintf("http://%s:%d/", ip, port))
}

// expectReach waits until each of want holds: from reaches ip:port (a
// pod's name answers) or not ("").
func (k *kubeCluster) expectReach(from string, ip netip.Addr, port int, want string) {
	k.t.Helper()
	if _, err := eventually(converges, func() error {
		got, err := k.reaches(from, ip, port)
		switch {
		case want == "" && err == nil:
			return fmt.Errorf("%s still reaches %s:%d (%s)", from, ip, port, got)
		case want != "" && (err != nil || got != "skiff-"+want):
			return fmt.Errorf("%s → %s:%d: %q %v, want skiff-%s", from, ip, port, got, err, want)
		}
		return nil
	}); err != nil {
		k.t.Error(err)
	}
}

// TestKubeNetworkPolicy: NetworkPolicy between real pods in auto, on both
// kinds of pod: db (h2) and cli (h1) run under skiff's seccomp profile
// (host sockets: connect-time judging), web (h1) does not (the cache and
// the overlay). A default-deny ingress policy isolates namespace shop;
// an allow from namespaces labelled team=front lets cli in, on db's named
// port http only; an egress policy with an ipBlock and an exception keeps
// web from db and nothing else; deleting the policies lifts the denies.
func TestKubeNetworkPolicy(t *testing.T) {
	_, k := kubeLab(t, "tknp", "auto", 0)
	k.startNodes(context.Background())
	for _, ns := range []string{"shop", "front"} {
		k.must(fmt.Sprintf("apiVersion: v1\nkind: Namespace\nmetadata: {name: %s, labels: {team: %s}}\n", ns, ns), "apply", "-f", "-")
	}
	both := webServer[:strings.Index(webServer, "exec httpd")] + "httpd -p 0.0.0.0:7000 -h /www && exec httpd -f -p 0.0.0.0:8080 -h /www"
	db := k.runPod("shop", "db", "h2", "app: db", both, true)
	web := k.runPod("shop", "web", "h1", "app: web", webServer, false)
	cli := k.runPod("front", "cli", "h1", "app: cli", webServer, true)
	t.Logf("db %s, web %s, cli %s", db, web, cli)
	k.expectReach("front/cli", db, 8080, "db")
	k.expectReach("shop/web", db, 7000, "db")

	k.must(`apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: shop, name: default-deny}
spec:
  podSelector: {}
  policyTypes: [Ingress]
`, "apply", "-f", "-")
	k.expectReach("front/cli", db, 8080, "")
	k.expectReach("shop/web", db, 8080, "")
	k.expectReach("front/cli", web, 8080, "")
	k.expectReach("shop/db", cli, 8080, "cli") // front is not isolated

	k.must(`apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: shop, name: from-front}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {team: front}}}]
    ports: [{port: http}]
`, "apply", "-f", "-")
	k.expectReach("front/cli", db, 8080, "db")
	k.expectReach("front/cli", db, 7000, "") // not the named port
	k.expectReach("shop/web", db, 8080, "")  // not from front

	k.must("", "delete", "networkpolicy", "default-deny", "from-front", "-n", "shop")
	k.expectReach("shop/web", db, 8080, "db")
	k.must(fmt.Sprintf(`apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: shop, name: web-out}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: %s, except: [%s/32]}}]
`, kubeClusterCIDR, db), "apply", "-f", "-")
	k.expectReach("shop/web", db, 8080, "")
	k.expectReach("shop/web", cli, 8080, "cli")
	k.expectReach("front/cli", db, 8080, "db")
	k.must("", "delete", "networkpolicy", "web-out", "-n", "shop")
	k.expectReach("shop/web", db, 8080, "db")
}
