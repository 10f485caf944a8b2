package bench

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Metric directions ("better" in the JSON schema).
const (
	HigherIsBetter = "higher"
	LowerIsBetter  = "lower"
)

// Units used in reports (see SCHEMA.md).
const (
	unitGbps      = "Gbit/s"
	unitPercent   = "%"
	unitTxnPerSec = "txn/s"
	unitPktPerSec = "pkt/s"
	unitReqPerSec = "req/s"
	unitOpsPerSec = "ops/s"
	unitMicros    = "us"
	cpuPerGbit    = "cpu_s/Gbit"
	cpuPerTxn     = "cpu_us/txn"
)

// Tools the workloads run; "skiff-perf" is resolved from Options.PerfBin.
const (
	toolPerf      = "skiff-perf"
	toolIperf3    = "iperf3"
	toolMemcached = "memcached"
	toolNginx     = "nginx"
	toolWrk       = "wrk"
)

// metricDef describes one reported metric of a workload.
type metricDef struct {
	Name   string
	Unit   string
	Better string
}

// sample is one successful measurement of a cell.
type sample struct {
	Values map[string]float64 // by metric name
	Work   float64            // units of work done, for CPU per unit
	Rep    int                // the repetition, which pairs it with host's
}

// cellEnv is everything a workload needs to build its commands.
type cellEnv struct {
	ServerIP     netip.Addr // the server binds it
	DialIP       netip.Addr // clients connect to it: ServerIP, or the server's front (FrontLab)
	Port         int        // base port; a workload may also use Port+1
	Duration     time.Duration
	Warmup       time.Duration
	ConnectCount int
	Tools        map[string]string // tool name -> path
}

// serverSpec is how to start and recognise a running server.
type serverSpec struct {
	Argv    []string
	Ready   []listenPort
	Cleanup func() // removes files written for the server; may be nil
}

// clientSpec is the measured client run and an optional unrecorded warm-up.
// The warm-up is a run of its own, not a client option (skiff-perf --warmup,
// iperf3 -O): the CPU accounting covers the measured run only, and the work
// it divides by is the measured run's.
type clientSpec struct {
	Warmup []string // nil: no warm-up
	Run    []string
}

// workload is one benchmark: how to run it and how to read its result.
type workload struct {
	Name    string
	Metrics []metricDef // the first is the primary metric (chart)
	CPUUnit string
	Quick   bool // part of the quick profile
	Tools   []string
	Server  func(env cellEnv) (serverSpec, error)
	Client  func(env cellEnv) clientSpec
	Parse   func(res commandResult) (sample, error)
	// Estimate is the expected wall time of one cell, without overhead.
	Estimate func(env cellEnv) time.Duration
}

// cpuScale converts CPU seconds per unit of work into the workload's cpu unit.
func (w *workload) cpuScale() float64 {
	if w.CPUUnit == cpuPerTxn {
		return 1e6
	}
	return 1
}

// workloads is the registry, in report order.
var workloads = []*workload{
	iperfStream("tcp_stream", 1, 0, false, true),
	iperfStream("tcp_stream_4", 4, 0, false, false),
	iperfStream("udp_stream", 1, 1400, true, false),
	// Several senders overloading one UDP receiver (Falcon's and mFlow's
	// stress method): datagrams delivered a second, and loss.
	iperfStream("udp_stress", 3, 1400, true, false),
	iperfStream("udp_stress_64", 3, 64, true, false),
	iperfStream("udp_stress_8k", 3, 8192, true, false),
	perfWorkload("tcp_rr", "tcp_rr", true, latencyMetrics(unitTxnPerSec)),
	perfWorkload("udp_rr", "udp_rr", true, latencyMetrics(unitTxnPerSec)),
	perfWorkload("tcp_crr", "tcp_crr", true, []metricDef{{"rate", unitTxnPerSec, HigherIsBetter}}),
	connectWorkload(),
	memcachedWorkload("memcached", false),
	memcachedWorkload("memcached_crr", true),
	nginxWorkload("nginx", false),
	nginxWorkload("nginx_crr", true),
}

// WorkloadNames returns the workloads of the quick or the full profile, in
// report order.
func WorkloadNames(quick bool) []string {
	var names []string
	for _, w := range workloads {
		if w.Quick || !quick {
			names = append(names, w.Name)
		}
	}
	return names
}

func findWorkload(name string) (*workload, error) {
	for _, w := range workloads {
		if w.Name == name {
			return w, nil
		}
	}
	return nil, fmt.Errorf("unknown workload %q (valid: %s)", name, strings.Join(WorkloadNames(false), ", "))
}

// resolveWorkloads returns the requested workloads (default: the profile's),
// deduplicated, in report order.
func resolveWorkloads(requested []string, quick bool) ([]*workload, error) {
	if len(requested) == 0 {
		requested = WorkloadNames(quick)
	}
	want := map[string]bool{}
	for _, name := range requested {
		if _, err := findWorkload(name); err != nil {
			return nil, err
		}
		want[name] = true
	}
	var out []*workload
	for _, w := range workloads {
		if want[w.Name] {
			out = append(out, w)
		}
	}
	return out, nil
}

func latencyMetrics(rateUnit string) []metricDef {
	return []metricDef{
		{"rate", rateUnit, HigherIsBetter},
		{"p50", unitMicros, LowerIsBetter},
		{"p99", unitMicros, LowerIsBetter},
	}
}

// wholeDuration rounds d to whole seconds, at least one.
func wholeDuration(d time.Duration) time.Duration {
	return max(d.Round(time.Second), time.Second)
}

// wholeSeconds formats d for tools that take integer seconds (at least 1).
func wholeSeconds(d time.Duration) string {
	return strconv.Itoa(int(wholeDuration(d) / time.Second))
}

// seconds formats d as decimal seconds ("10", "0.5").
func seconds(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64)
}

func hostPort(ip netip.Addr, port int) string {
	return netip.AddrPortFrom(ip, uint16(port)).String()
}

// --- iperf3 streams ---------------------------------------------------------

// iperfStream is iperf3 with flows parallel streams; UDP datagrams of size
// bytes at an unlimited rate. A UDP stress (flows > 1) reports its
// delivered datagrams a second first.
func iperfStream(name string, flows, size int, udp, quick bool) *workload {
	metrics := []metricDef{{"throughput", unitGbps, HigherIsBetter}}
	if udp {
		metrics = append(metrics, metricDef{"loss", unitPercent, LowerIsBetter})
	}
	stress := udp && flows > 1
	if stress {
		metrics = append([]metricDef{{"rate", unitPktPerSec, HigherIsBetter}}, metrics...)
	}
	return &workload{
		Name: name, Metrics: metrics, CPUUnit: cpuPerGbit, Quick: quick, Tools: []string{toolIperf3},
		Server: func(env cellEnv) (serverSpec, error) {
			return serverSpec{
				Argv:  []string{env.Tools[toolIperf3], "-s", "-p", strconv.Itoa(env.Port), "-B", env.ServerIP.String()},
				Ready: []listenPort{{"tcp", env.Port}},
			}, nil
		},
		Client: func(env cellEnv) clientSpec {
			iperf := func(d time.Duration, extra ...string) []string {
				argv := append([]string{env.Tools[toolIperf3], "-c", env.DialIP.String(), "-p", strconv.Itoa(env.Port),
					"-t", wholeSeconds(d)}, extra...)
				if flows > 1 {
					argv = append(argv, "-P", strconv.Itoa(flows))
				}
				if udp {
					argv = append(argv, "-u", "-b", "0", "-l", strconv.Itoa(size))
				}
				return argv
			}
			return clientSpec{Warmup: iperf(env.Warmup), Run: iperf(env.Duration, "-J")}
		},
		Parse: func(res commandResult) (sample, error) {
			r, err := parseIperf3(res.Stdout, udp)
			if err != nil {
				return sample{}, withExit(err, res)
			}
			gbit := r.Bytes * 8 / 1e9
			if gbit <= 0 {
				return sample{}, fmt.Errorf("iperf3: no data received")
			}
			values := map[string]float64{"throughput": r.BitsPerSecond / 1e9}
			if udp {
				values["loss"] = r.LostPercent
			}
			if stress {
				values["rate"] = r.BitsPerSecond / 8 / float64(size)
			}
			return sample{Values: values, Work: gbit}, nil
		},
		Estimate: func(env cellEnv) time.Duration { return wholeDuration(env.Warmup) + wholeDuration(env.Duration) },
	}
}

// --- skiff-perf -------------------------------------------------------------

// perfServer starts `skiff-perf server`, waiting for the socket test uses.
func perfServer(ready func(port int) listenPort) func(env cellEnv) (serverSpec, error) {
	return func(env cellEnv) (serverSpec, error) {
		return serverSpec{
			Argv:  []string{env.Tools[toolPerf], "server", "--bind", env.ServerIP.String(), "--port", strconv.Itoa(env.Port)},
			Ready: []listenPort{ready(env.Port)},
		}, nil
	}
}

// perfClient runs skiff-perf's test with the run's arguments after a
// warm-up of the same test.
func perfClient(env cellEnv, test string, run []string, extra ...string) clientSpec {
	argv := []string{env.Tools[toolPerf], "client", "--test", test,
		"--host", env.DialIP.String(), "--port", strconv.Itoa(env.Port)}
	warmup := slices.Concat(argv, []string{"--duration", seconds(env.Warmup)}, extra)
	return clientSpec{Warmup: warmup, Run: slices.Concat(argv, run, extra)}
}

// perfWorkload is a time-bound skiff-perf test (rr, crr).
func perfWorkload(name, test string, quick bool, metrics []metricDef) *workload {
	proto := "tcp"
	if strings.HasPrefix(test, "udp") {
		proto = "udp"
	}
	return &workload{
		Name: name, Metrics: metrics, CPUUnit: cpuPerTxn, Quick: quick, Tools: []string{toolPerf},
		Server: perfServer(func(port int) listenPort { return listenPort{proto, port} }),
		Client: func(env cellEnv) clientSpec {
			return perfClient(env, test, []string{"--duration", seconds(env.Duration)})
		},
		Parse:    parsePerfSample,
		Estimate: func(env cellEnv) time.Duration { return env.Warmup + env.Duration },
	}
}

// connectWorkload times --count connection setups against TCP port+1.
func connectWorkload() *workload {
	return &workload{
		Name: "connect", CPUUnit: cpuPerTxn, Quick: true, Tools: []string{toolPerf},
		Metrics: []metricDef{
			{"p50", unitMicros, LowerIsBetter},
			{"p99", unitMicros, LowerIsBetter},
			{"p999", unitMicros, LowerIsBetter},
		},
		Server: perfServer(func(port int) listenPort { return listenPort{"tcp", port + 1} }),
		Client: func(env cellEnv) clientSpec {
			return perfClient(env, "connect", []string{"--count", strconv.Itoa(env.ConnectCount)})
		},
		Parse: parsePerfSample,
		Estimate: func(env cellEnv) time.Duration {
			return env.Warmup + time.Duration(env.ConnectCount)*250*time.Microsecond
		},
	}
}

func memcachedWorkload(name string, newConn bool) *workload {
	return &workload{
		Name: name, Metrics: latencyMetrics(unitOpsPerSec), CPUUnit: cpuPerTxn, Tools: []string{toolPerf, toolMemcached},
		Server: func(env cellEnv) (serverSpec, error) {
			return serverSpec{
				Argv: []string{env.Tools[toolMemcached], "-u", "root", "-l", env.ServerIP.String(),
					"-p", strconv.Itoa(env.Port), "-U", "0", "-t", "2"},
				Ready: []listenPort{{"tcp", env.Port}},
			}, nil
		},
		Client: func(env cellEnv) clientSpec {
			extra := []string{"--connections", "50"}
			if newConn {
				extra = append(extra, "--new-conn")
			}
			return perfClient(env, "memcached", []string{"--duration", seconds(env.Duration)}, extra...)
		},
		Parse:    parsePerfSample,
		Estimate: func(env cellEnv) time.Duration { return env.Warmup + env.Duration },
	}
}

// parsePerfSample turns skiff-perf output into rate, p50, p99, p999 and the
// transaction count. Exit codes: 0 ok, 1 cannot connect, 2 errors, 64 usage.
func parsePerfSample(res commandResult) (sample, error) {
	switch res.ExitCode {
	case 0, 2:
	case 1:
		return sample{}, withExit(fmt.Errorf("skiff-perf: cannot connect"), res)
	case 64:
		return sample{}, withExit(fmt.Errorf("skiff-perf: usage error"), res)
	default:
		return sample{}, withExit(fmt.Errorf("skiff-perf failed"), res)
	}
	r, err := parsePerf(res.Stdout)
	if err != nil {
		return sample{}, withExit(err, res)
	}
	if res.ExitCode != 0 {
		return sample{}, withExit(fmt.Errorf("skiff-perf %s reported failure", r.Test), res)
	}
	if r.Transactions <= 0 {
		return sample{}, fmt.Errorf("skiff-perf %s: no transaction completed", r.Test)
	}
	return sample{
		Values: map[string]float64{"rate": r.Rate, "p50": r.P50, "p99": r.P99, "p999": r.P999},
		Work:   r.Transactions,
	}, nil
}

// --- nginx + wrk ------------------------------------------------------------

func nginxWorkload(name string, closeConn bool) *workload {
	return &workload{
		Name: name, Metrics: latencyMetrics(unitReqPerSec), CPUUnit: cpuPerTxn, Tools: []string{toolNginx, toolWrk},
		Server: nginxServer,
		Client: func(env cellEnv) clientSpec {
			url := "http://" + hostPort(env.DialIP, env.Port) + "/index.html"
			wrk := func(d time.Duration, latency bool) []string {
				argv := []string{env.Tools[toolWrk], "-t2", "-c100", "-d", wholeSeconds(d) + "s"}
				if latency {
					argv = append(argv, "--latency")
				}
				if closeConn {
					argv = append(argv, "-H", "Connection: close")
				}
				return append(argv, url)
			}
			return clientSpec{Warmup: wrk(env.Warmup, false), Run: wrk(env.Duration, true)}
		},
		Parse: func(res commandResult) (sample, error) {
			if res.ExitCode != 0 {
				return sample{}, withExit(fmt.Errorf("wrk failed"), res)
			}
			r, err := parseWrk(res.Stdout)
			if err != nil {
				return sample{}, err
			}
			return sample{
				Values: map[string]float64{"rate": r.RequestsSec, "p50": r.P50, "p99": r.P99},
				Work:   r.Requests,
			}, nil
		},
		Estimate: func(env cellEnv) time.Duration {
			return wholeDuration(env.Warmup) + wholeDuration(env.Duration)
		},
	}
}

// nginxConf is a self-contained configuration: every path nginx writes is
// inside dir, so no system file is touched.
const nginxConf = `daemon off;
master_process off;
worker_processes 1;
pid {{DIR}}/nginx.pid;
error_log {{DIR}}/error.log crit;
events { worker_connections 4096; }
http {
    access_log off;
    sendfile on;
    keepalive_requests 1000000;
    client_body_temp_path {{DIR}}/client_body;
    proxy_temp_path {{DIR}}/proxy;
    fastcgi_temp_path {{DIR}}/fastcgi;
    uwsgi_temp_path {{DIR}}/uwsgi;
    scgi_temp_path {{DIR}}/scgi;
    server {
        listen {{LISTEN}};
        root {{DIR}}/www;
    }
}
`

// WriteNginxFiles writes a self-contained nginx.conf serving dir/www on
// listen, and a 1 KiB www/index.html, into dir (also for other packages'
// tests that need a real web server).
func WriteNginxFiles(dir, listen string) error {
	conf := strings.NewReplacer("{{DIR}}", dir, "{{LISTEN}}", listen).Replace(nginxConf)
	if err := os.WriteFile(filepath.Join(dir, "nginx.conf"), []byte(conf), 0o644); err != nil {
		return err
	}
	if err := os.Mkdir(filepath.Join(dir, "www"), 0o755); err != nil {
		return err
	}
	page := []byte(strings.Repeat("skiff bench page.\n", 57)[:1023] + "\n")
	return os.WriteFile(filepath.Join(dir, "www", "index.html"), page, 0o644)
}

func nginxServer(env cellEnv) (serverSpec, error) {
	dir, err := os.MkdirTemp("", "skiff-bench-nginx-")
	if err != nil {
		return serverSpec{}, fmt.Errorf("nginx temp dir: %w", err)
	}
	if err := WriteNginxFiles(dir, hostPort(env.ServerIP, env.Port)); err != nil {
		os.RemoveAll(dir)
		return serverSpec{}, fmt.Errorf("write nginx config: %w", err)
	}
	return serverSpec{
		Argv: []string{env.Tools[toolNginx], "-p", dir, "-c", filepath.Join(dir, "nginx.conf"),
			"-e", filepath.Join(dir, "error.log")},
		Ready:   []listenPort{{"tcp", env.Port}},
		Cleanup: func() { os.RemoveAll(dir) },
	}, nil
}

// withExit adds the exit code and the tail of stderr to a client failure.
func withExit(err error, res commandResult) error {
	var detail string
	if res.ExitCode != 0 {
		detail = fmt.Sprintf(" (exit status %d)", res.ExitCode)
	}
	if tail := strings.TrimSpace(res.Stderr); tail != "" {
		detail += ": " + lastLines(tail, 3)
	}
	return fmt.Errorf("%w%s", err, detail)
}
