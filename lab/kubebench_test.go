package lab

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/bench"
	"github.com/skiffnet/skiff/cgroup"
)

// The Kubernetes benchmarks (make bench-kube; docs/kubernetes.md): go test
// runs them only when asked (-bench Kube), each once (-benchtime 1x). They
// write their results to $SKIFF_KUBE_BENCH_OUT (default docs/bench).

// kubeBenchPorts is how many port blocks the benchmark's Service exposes
// (bench.PortStride ports each, from bench.BasePort).
const kubeBenchPorts = 16

// kubeBenchModes are the benchmark's modes for pods: pod-to-pod across the
// nodes and through a ClusterIP Service, each as the lab's auto mode
// runs its containers (the shim preloaded, as an image that preloads it)
// and as an unmodified image runs (no preload: its TCP takes the cache).
var kubeBenchModes = map[string]bench.Mode{
	"pod": {Name: "pod", LabMode: "auto",
		Placement:   bench.Placement{CrossHost: bench.Endpoints{Server: "pod:h1", Client: "pod:h2"}},
		Description: "pods on two nodes, the shim preloaded (lab auto's containers in pods)"},
	"pod-plain": {Name: "pod-plain", LabMode: "auto",
		Placement:   bench.Placement{CrossHost: bench.Endpoints{Server: "pod:h1", Client: "pod:h2"}},
		Wrap:        func(cmd *exec.Cmd) { bench.UnsetEnv(cmd, "LD_PRELOAD") },
		Description: "pods on two nodes as an unmodified image runs in them"},
	"service": {Name: "service", LabMode: "auto",
		Placement:   bench.Placement{CrossHost: bench.Endpoints{Server: "svc:h1", Client: "pod:h2"}},
		Description: "pod to a ClusterIP Service whose backend is a pod on the other node, the shim preloaded"},
	"service-plain": {Name: "service-plain", LabMode: "auto",
		Placement:   bench.Placement{CrossHost: bench.Endpoints{Server: "svc:h1", Client: "pod:h2"}},
		Wrap:        func(cmd *exec.Cmd) { bench.UnsetEnv(cmd, "LD_PRELOAD") },
		Description: "pod to a ClusterIP Service as an unmodified image runs in it"},
}

// kubeBenchLab is a kube lab as the benchmark sees it: its hosts and
// containers as the lab's, and targets "pod:HOST" (the bench pod on node
// HOST) and "svc:HOST" (that pod behind the Service bench, whose ClusterIP
// clients dial).
type kubeBenchLab struct {
	*Lab
	pods      map[string]benchPod // by node
	clusterIP netip.Addr
}

// benchPod is a pod the benchmark runs its programs in: in its network
// namespace and cgroup, with the bounding set a runtime gives a container.
type benchPod struct {
	ip     netip.Addr
	netns  string
	cgroup string
}

func (kl *kubeBenchLab) pod(target string) (benchPod, bool) {
	kind, node, ok := strings.Cut(target, ":")
	if !ok || (kind != "pod" && kind != "svc") {
		return benchPod{}, false
	}
	p, ok := kl.pods[node]
	return p, ok
}

func (kl *kubeBenchLab) IP(target string) (netip.Addr, error) {
	if p, ok := kl.pod(target); ok {
		return p.ip, nil
	}
	if strings.Contains(target, ":") {
		return netip.Addr{}, fmt.Errorf("no bench pod %q", target)
	}
	return kl.Lab.IP(target)
}

func (kl *kubeBenchLab) Front(target string) (netip.Addr, bool) {
	return kl.clusterIP, strings.HasPrefix(target, "svc:")
}

func (kl *kubeBenchLab) PortBlocks() int { return kubeBenchPorts }

func (kl *kubeBenchLab) Command(ctx context.Context, target, name string, args ...string) (*exec.Cmd, error) {
	p, ok := kl.pod(target)
	if !ok {
		return kl.Lab.Command(ctx, target, name, args...)
	}
	argv := append([]string{"nsenter", "--net=" + p.netns, "--", "setpriv", "--bounding-set", RuntimeCaps, "--", name}, args...)
	cmd := exec.CommandContext(ctx, "sh", append([]string{"-c", `echo $$ > "$0/cgroup.procs" && exec "$@"`, p.cgroup}, argv...)...)
	cmd.Env = append(os.Environ(), "LD_PRELOAD="+kl.Shim())
	return cmd, nil
}

// Listening adds a bench pod's listeners on host sockets.
func (kl *kubeBenchLab) Listening(ctx context.Context, target string) ([]netip.AddrPort, error) {
	p, ok := kl.pod(target)
	if !ok {
		return kl.Lab.Listening(ctx, target)
	}
	_, node, _ := strings.Cut(target, ":")
	return kl.ListenersOf(ctx, node, p.ip)
}

// kubeBenchOut is the file name under $SKIFF_KUBE_BENCH_OUT (default the
// repository's docs/bench) a benchmark writes.
func kubeBenchOut(b *testing.B, name string) string {
	dir := os.Getenv("SKIFF_KUBE_BENCH_OUT")
	if dir == "" {
		dir, _ = filepath.Abs(filepath.Join("..", "docs", "bench"))
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	return filepath.Join(dir, name)
}

// BenchmarkKube runs tcp_stream, tcp_rr, tcp_crr and nginx between pods on
// two nodes of a kube lab in auto, directly and through a ClusterIP
// Service, beside the same lab's host namespaces (the baseline) and its
// containers in auto, interleaved in one run. It writes kube.json and
// kube.md and logs the two targets: pod-to-pod within 5 % of the
// lab's containers, tcp_crr through the Service ≥ 0.8 × pod-to-pod.
// SKIFF_KUBE_BENCH_REPEAT and SKIFF_KUBE_BENCH_CELL change the default 5
// repetitions of 3 s cells.
func BenchmarkKube(b *testing.B) {
	l, k := kubeLab(b, "bkube", "auto", 1)
	ctx := context.Background()
	k.startNodes(ctx)
	kl := &kubeBenchLab{Lab: l, pods: map[string]benchPod{}}
	root, err := cgroup.Root()
	if err != nil {
		b.Fatal(err)
	}
	for _, node := range []string{"h1", "h2"} {
		name := "bench-" + node
		ip := k.runPod("default", name, node, "app: "+name, "exec sleep 36000", true)
		e := podEndpoint(b, l, node, "default", name)
		if e == nil || e.Cgroup == "" {
			b.Fatalf("pod %s: no endpoint with a cgroup on %s: %+v", name, node, e)
		}
		cg, err := cgroup.Dir(root, e.Endpoint)
		if err != nil {
			b.Fatal(err)
		}
		kl.pods[node] = benchPod{ip: ip, netns: e.Netns, cgroup: cg}
	}
	var ports []string
	for p := bench.BasePort; p < bench.BasePort+kubeBenchPorts*bench.PortStride; p++ {
		ports = append(ports, fmt.Sprintf("{name: p%d, port: %d}", p, p))
	}
	k.must(fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: bench}
spec:
  selector: {app: bench-h1}
  ports: [%s]
`, strings.Join(ports, ", ")), "apply", "-f", "-")
	if kl.clusterIP, err = netip.ParseAddr(k.must("", "get", "service", "bench", "-o", "jsonpath={.spec.clusterIP}")); err != nil {
		b.Fatal(err)
	}
	for name, m := range kubeBenchModes {
		bench.Modes[name] = m
	}
	b.Cleanup(func() {
		for name := range kubeBenchModes {
			delete(bench.Modes, name)
		}
	})
	repeat, _ := strconv.Atoi(os.Getenv("SKIFF_KUBE_BENCH_REPEAT"))
	cell, _ := time.ParseDuration(os.Getenv("SKIFF_KUBE_BENCH_CELL"))
	opts := bench.Options{
		Modes:     []string{"host", "auto", "auto-plain", "pod", "pod-plain", "service", "service-plain"},
		Workloads: []string{"tcp_stream", "tcp_rr", "tcp_crr", "nginx"},
		Repeat:    cmp.Or(repeat, 5), CellDuration: cmp.Or(cell, 3*time.Second),
		PerfBin: filepath.Join(l.Config.BinDir, "skiff-perf"), Progress: os.Stderr,
	}
	b.ResetTimer()
	rep, runErr := bench.Run(ctx, kl, opts)
	b.StopTimer()
	if rep == nil {
		b.Fatal(runErr)
	}
	var out strings.Builder
	if err := rep.WriteTable(&out); err != nil {
		b.Fatal(err)
	}
	b.Logf("\n%s", out.String())
	for name, write := range map[string]func(f *os.File) error{
		"kube.json": func(f *os.File) error { return rep.WriteJSON(f) },
		"kube.md":   func(f *os.File) error { return rep.WriteMarkdown(f) },
	} {
		f, err := os.Create(kubeBenchOut(b, name))
		if err == nil {
			err = errors.Join(write(f), f.Close())
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	for _, v := range kubeVerdicts(rep) {
		b.Log(v)
	}
	if runErr != nil {
		b.Error(runErr)
	}
}

// kubeVerdicts judges a kube run against the targets: each
// workload's primary metric in pod (pod-plain) against auto (auto-plain),
// within 5 %; tcp_crr through the Service at least 0.8 × pod-to-pod.
func kubeVerdicts(rep *bench.Report) []string {
	var out []string
	median := func(workload, mode string) (float64, bool) {
		var m float64
		var ok bool
		for _, r := range rep.Results {
			if r.Workload == workload && r.Mode == mode && r.Median != nil && !ok {
				m, ok = *r.Median, true // the first metric is the primary one
			}
		}
		return m, ok
	}
	judge := func(what string, got, want float64, ok bool) {
		verdict := "PASS"
		if !ok {
			verdict = "NO DATA"
		} else if got < want {
			verdict = "MISS"
		}
		out = append(out, fmt.Sprintf("%-7s %s: %.3f (target ≥ %.2f)", verdict, what, got, want))
	}
	for _, w := range rep.Config.Workloads {
		for _, pair := range [][2]string{{"pod", "auto"}, {"pod-plain", "auto-plain"}} {
			p, ok1 := median(w, pair[0])
			a, ok2 := median(w, pair[1])
			judge(fmt.Sprintf("%s %s / %s", w, pair[0], pair[1]), p/a, 0.95, ok1 && ok2 && a > 0)
		}
	}
	for _, pair := range [][2]string{{"service", "pod"}, {"service-plain", "pod-plain"}} {
		s, ok1 := median("tcp_crr", pair[0])
		p, ok2 := median("tcp_crr", pair[1])
		judge(fmt.Sprintf("tcp_crr %s / %s", pair[0], pair[1]), s/p, 0.8, ok1 && ok2 && p > 0)
	}
	return out
}

// BenchmarkKubePodBurst starts 50 pods on each of two nodes at once (one
// kubectl apply) and times every CNI call the CRI makes for them: skiff-cni
// and portmap, each ADD and, when the pods are deleted, each DEL (linkPlugin
// wraps the plugins). It writes kube-burst.json: per plugin and command,
// the calls' p50, p99 and max, and how long until every pod was Ready.
// The target: skiff-cni's ADD p99 ≤ 100 ms.
func BenchmarkKubePodBurst(b *testing.B) {
	const perNode = 50
	l, k := kubeLab(b, "bburst", "auto", 0)
	k.cniTimes = filepath.Join(b.TempDir(), "cni-times")
	ctx := context.Background()
	k.startNodes(ctx)
	var specs []string
	for _, node := range []string{"h1", "h2"} {
		for i := range perNode {
			specs = append(specs, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: burst-%s-%d, labels: {app: burst}}
spec:
  nodeName: %s
  terminationGracePeriodSeconds: 1
  containers: [{name: c, image: skiff.dev/busybox:1.35.0, command: [sleep, "3600"]}]
`, node, i, node))
		}
	}
	b.ResetTimer()
	start := time.Now()
	k.must(strings.Join(specs, "---\n"), "apply", "-f", "-")
	if _, err := k.kubectl("", "wait", "--for=condition=Ready", "pod", "-l", "app=burst", "--timeout=600s"); err != nil {
		b.Fatal(err)
	}
	ready := time.Since(start)
	start = time.Now()
	k.must("", "delete", "pods", "-l", "app=burst", "--wait=true", "--timeout=600s")
	deleted := time.Since(start)
	b.StopTimer()
	// The CRI's DELs of the last sandboxes may follow the API's deletion.
	want := 2 * 2 * perNode // ADD and DEL, both nodes
	var calls []cniCall
	if _, err := eventually(60*time.Second, func() (err error) {
		if calls, err = readCNITimes(k.cniTimes); err == nil && countCalls(calls, "skiff-cni") < want {
			err = fmt.Errorf("%d skiff-cni calls of %d", countCalls(calls, "skiff-cni"), want)
		}
		return err
	}); err != nil {
		b.Fatal(err)
	}
	res := kubeBurst{Schema: "skiff-kube-burst/v1", PodsPerNode: perNode, Nodes: 2,
		ReadySeconds: ready.Seconds(), DeletedSeconds: deleted.Seconds()}
	for _, plugin := range []string{"skiff-cni", "portmap"} {
		for _, command := range []string{"ADD", "DEL"} {
			var ms []float64
			failed := 0
			for _, c := range calls {
				if c.plugin == plugin && c.command == command {
					ms = append(ms, c.ms)
					if c.rc != 0 {
						failed++
					}
				}
			}
			if len(ms) == 0 {
				continue
			}
			slices.Sort(ms)
			res.Calls = append(res.Calls, burstCalls{Plugin: plugin, Command: command, Count: len(ms), Failed: failed,
				P50: quantile(ms, 0.50), P99: quantile(ms, 0.99), Max: ms[len(ms)-1]})
		}
	}
	// The agents' view of each ADD and DEL: where its time went, and the
	// steps of the overlay's slow ones.
	parts := agentTimes(b, l)
	for _, h := range l.Hosts {
		log, _ := os.ReadFile(filepath.Join(l.hostDir(h.Name), "skiffd.log"))
		for _, line := range strings.Split(string(log), "\n") {
			if strings.Contains(line, ` slow" `) {
				b.Logf("%s: %s", h.Name, line)
			}
		}
	}
	for _, what := range []struct {
		msg, command string
		parts        []string
	}{
		{"endpoint added", "ADD", []string{"took_ms", "wait_ms", "store_ms", "overlay_ms", "layers_ms", "record_ms"}},
		{"endpoint deleted", "DEL", []string{"took_ms", "wait_ms", "store_ms", "layers_ms", "overlay_ms", "release_ms"}},
	} {
		for _, part := range what.parts {
			ms := parts[what.msg][part]
			if len(ms) == 0 {
				b.Fatalf("no %s in the agents' logs of %q", part, what.msg)
			}
			slices.Sort(ms)
			res.Agent = append(res.Agent, burstCalls{Plugin: "skiffd", Command: what.command + " " + strings.TrimSuffix(part, "_ms"),
				Count: len(ms), P50: quantile(ms, 0.50), P99: quantile(ms, 0.99), Max: ms[len(ms)-1]})
		}
	}
	f, err := os.Create(kubeBenchOut(b, "kube-burst.json"))
	if err == nil {
		enc := json.NewEncoder(f)
		enc.SetIndent("", "  ")
		err = errors.Join(enc.Encode(res), f.Close())
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("%d pods per node: all Ready in %.1f s, deleted in %.1f s", perNode, res.ReadySeconds, res.DeletedSeconds)
	for _, c := range append(res.Calls, res.Agent...) {
		verdict := ""
		if c.Plugin == "skiff-cni" && c.Command == "ADD" {
			verdict = map[bool]string{true: "  PASS (target p99 ≤ 100 ms)", false: "  MISS (target p99 ≤ 100 ms)"}[c.P99 <= 100]
		}
		b.Logf("%-9s %-11s %3d calls (%d failed): p50 %.1f ms, p99 %.1f ms, max %.1f ms%s",
			c.Plugin, c.Command, c.Count, c.Failed, c.P50, c.P99, c.Max, verdict)
	}
}

// agentTimes reads where the agents' ADDs and DELs spent their time from
// their logs: by message ("endpoint added", "endpoint deleted"), by part
// (took_ms, wait_ms, ...), in milliseconds.
func agentTimes(tb testing.TB, l *Lab) map[string]map[string][]float64 {
	tb.Helper()
	parts := map[string]map[string][]float64{"endpoint added": {}, "endpoint deleted": {}}
	for _, h := range l.Hosts {
		log, err := os.ReadFile(filepath.Join(l.hostDir(h.Name), "skiffd.log"))
		if err != nil {
			tb.Fatal(err)
		}
		for _, line := range strings.Split(string(log), "\n") {
			for msg, p := range parts {
				if !strings.Contains(line, `msg="`+msg+`"`) {
					continue
				}
				for _, f := range strings.Fields(line) {
					if k, v, ok := strings.Cut(f, "="); ok && strings.HasSuffix(k, "_ms") {
						if ms, err := strconv.ParseFloat(v, 64); err == nil {
							p[k] = append(p[k], ms)
						}
					}
				}
			}
		}
	}
	return parts
}

// kubeBurst is kube-burst.json: BenchmarkKubePodBurst's figures (ms).
type kubeBurst struct {
	Schema         string       `json:"schema"`
	PodsPerNode    int          `json:"podsPerNode"`
	Nodes          int          `json:"nodes"`
	ReadySeconds   float64      `json:"readySeconds"`   // apply until every pod Ready
	DeletedSeconds float64      `json:"deletedSeconds"` // delete until every pod gone from the API
	Calls          []burstCalls `json:"calls"`
	// Agent is skiffd's view of each ADD and DEL (its log): took, and the
	// parts of it — wait (before the agent's lock, mostly waiting for it);
	// for ADD store (the address), overlay (veth, addresses, routes),
	// layers, record; for DEL store (reading the record), layers, overlay,
	// release.
	Agent []burstCalls `json:"agent"`
}

type burstCalls struct {
	Plugin  string  `json:"plugin"`
	Command string  `json:"command"`
	Count   int     `json:"count"`
	Failed  int     `json:"failed"`
	P50     float64 `json:"p50Ms"`
	P99     float64 `json:"p99Ms"`
	Max     float64 `json:"maxMs"`
}

// cniCall is one line linkPlugin's script wrote.
type cniCall struct {
	plugin, command string
	ms              float64
	rc              int
}

func readCNITimes(path string) ([]cniCall, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var calls []cniCall
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		// host plugin command container start end rc
		f := strings.Fields(line)
		if len(f) != 7 {
			return nil, fmt.Errorf("cni times: bad line %q", line)
		}
		start, err1 := strconv.ParseInt(f[4], 10, 64)
		end, err2 := strconv.ParseInt(f[5], 10, 64)
		rc, err3 := strconv.Atoi(f[6])
		if err := errors.Join(err1, err2, err3); err != nil {
			return nil, fmt.Errorf("cni times: %q: %w", line, err)
		}
		calls = append(calls, cniCall{plugin: f[1], command: f[2], ms: float64(end-start) / 1e6, rc: rc})
	}
	return calls, nil
}

func countCalls(calls []cniCall, plugin string) int {
	n := 0
	for _, c := range calls {
		if c.plugin == plugin {
			n++
		}
	}
	return n
}

// quantile of sorted values, nearest rank.
func quantile(sorted []float64, q float64) float64 {
	i := int(float64(len(sorted))*q+0.999999) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}
