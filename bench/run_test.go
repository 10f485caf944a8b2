package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The test binary doubles as a fake skiff-perf: the fake lab starts it with
// SKIFF_BENCH_FAKE_PERF=1, and it then serves or measures real loopback
// traffic and prints skiff-perf's JSON line. SKIFF_BENCH_FAKE_FAIL=1 makes
// the client report errors (exit 2), like a broken data path would.
func TestMain(m *testing.M) {
	if os.Getenv("SKIFF_BENCH_FAKE_PERF") == "1" {
		os.Exit(fakePerf(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// fakeLab maps every lab target to loopback and runs commands locally.
type fakeLab struct {
	mode      string
	healthErr error
}

func (l *fakeLab) IP(target string) (netip.Addr, error) {
	switch target {
	case "h1", "h2", "h1/c1", "h1/c2", "h2/c1":
		return netip.MustParseAddr("127.0.0.1"), nil
	}
	return netip.Addr{}, fmt.Errorf("no target %q", target)
}

func (l *fakeLab) Command(ctx context.Context, target, name string, args ...string) (*exec.Cmd, error) {
	if _, err := l.IP(target); err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), "SKIFF_BENCH_FAKE_PERF=1")
	return cmd, nil
}

func (l *fakeLab) Healthy(context.Context) error { return l.healthErr }
func (l *fakeLab) Mode() string                  { return l.mode }

func fakeOptions(progress *bytes.Buffer) Options {
	return Options{
		Quick: true, CellDuration: 300 * time.Millisecond, ConnectCount: 200,
		PerfBin: os.Args[0], Progress: progress,
	}
}

func TestRunWithFakeLab(t *testing.T) {
	// A mode whose Wrap breaks the client: exercises Wrap and the failure path.
	Modes["broken"] = Mode{Name: "broken", LabMode: "overlay", Placement: ContainerPlacement,
		Wrap: func(cmd *exec.Cmd) { SetEnv(cmd, "SKIFF_BENCH_FAKE_FAIL", "1") }}
	t.Cleanup(func() { delete(Modes, "broken") })

	var progress bytes.Buffer
	opts := fakeOptions(&progress)
	opts.Modes = []string{"overlay", "broken", "host"}
	opts.Workloads = []string{"tcp_rr", "udp_rr", "connect"}
	opts.Repeat = 2
	rep, err := Run(context.Background(), &fakeLab{mode: "overlay"}, opts)
	t.Logf("progress:\n%s", progress.String())
	if !errors.Is(err, ErrIncomplete) || rep == nil {
		t.Fatalf("Run = %v, %v; want a report and ErrIncomplete", rep, err)
	}
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	if err := ValidateJSON(buf.Bytes()); err != nil {
		t.Fatalf("ValidateJSON: %v\n%s", err, buf.String())
	}
	if got := strings.Join(rep.Config.Modes, ","); got != "host,overlay,broken" {
		t.Errorf("modes = %s", got)
	}
	for _, w := range opts.Workloads {
		for _, m := range []string{"host", "overlay"} {
			res, ok := rep.find(w, m, map[string]string{"connect": "p50"}[w]+map[bool]string{true: "rate"}[w != "connect"])
			if !ok || res.Median == nil || len(res.Samples) != 2 || res.RatioToHost == nil || res.CPUPerUnit == nil {
				t.Errorf("%s/%s: %+v", w, m, res)
			}
		}
	}
	if len(rep.Failures) != 6 || !strings.Contains(rep.Failures[0].Error, "errors") || rep.Failures[0].Mode != "broken" {
		t.Errorf("failures = %+v", rep.Failures)
	}
	for _, want := range []string{"skiff bench: 3 modes × 3 workloads × 2 reps = 18 cells", "[ 1/18] rep 1/2 tcp_rr  host",
		"[18/18] rep 2/2 connect", "ok rate", "FAILED: warm-up: skiff-perf", "left)"} {
		if !strings.Contains(progress.String(), want) {
			t.Errorf("progress lacks %q", want)
		}
	}
	assertNoServersLeft(t)
}

func TestRunSameHostComplete(t *testing.T) {
	var progress bytes.Buffer
	opts := fakeOptions(&progress)
	opts.SameHost = true
	opts.Workloads = []string{"tcp_crr", "connect"}
	rep, err := Run(context.Background(), &fakeLab{mode: "overlay"}, opts)
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, progress.String())
	}
	if !rep.Config.SameHost || len(rep.Failures) != 0 || rep.Config.Profile != ProfileQuick || rep.Config.Repeat != 1 {
		t.Errorf("config = %+v, failures %+v", rep.Config, rep.Failures)
	}
	assertNoServersLeft(t)
}

// flushingLab counts conntrack flushes; the flushes after the first fail.
type flushingLab struct {
	fakeLab
	flushes int
}

func (l *flushingLab) FlushConntrack() error {
	l.flushes++
	if l.flushes > 1 {
		return errors.New("flush conntrack in h1: operation not permitted")
	}
	return nil
}

func TestRunFlushesConntrackBeforeEachCell(t *testing.T) {
	opts := fakeOptions(&bytes.Buffer{})
	opts.Modes = []string{"host"}
	opts.Workloads = []string{"tcp_rr", "tcp_crr"}
	l := &flushingLab{fakeLab: fakeLab{mode: "overlay"}}
	rep, err := Run(context.Background(), l, opts)
	if l.flushes != 2 {
		t.Errorf("%d flushes for 2 cells", l.flushes)
	}
	// The first cell ran on clean tables; the second could not start clean.
	if !errors.Is(err, ErrIncomplete) || len(rep.Failures) != 1 || rep.Failures[0].Workload != "tcp_crr" ||
		!strings.Contains(rep.Failures[0].Error, "operation not permitted") {
		t.Fatalf("Run = %v; failures %+v", err, rep.Failures)
	}
	assertNoServersLeft(t)
}

func TestRunRefuses(t *testing.T) {
	tests := []struct {
		name    string
		lab     *fakeLab
		opts    func(o *Options)
		wantErr string
	}{
		{"unhealthy", &fakeLab{mode: "overlay", healthErr: errors.New("agent h2 down")}, func(*Options) {},
			"lab is not healthy, refusing to benchmark: agent h2 down"},
		{"wrong lab mode", &fakeLab{mode: "cache"}, func(o *Options) { o.Modes = []string{"host", "overlay"} },
			`needs a lab in "overlay" mode`},
		{"unknown workload", &fakeLab{mode: "overlay"}, func(o *Options) { o.Workloads = []string{"ping"} },
			"unknown workload"},
		{"negative repeat", &fakeLab{mode: "overlay"}, func(o *Options) { o.Repeat = -1 }, "must not be negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := fakeOptions(&bytes.Buffer{})
			tt.opts(&opts)
			rep, err := Run(context.Background(), tt.lab, opts)
			if rep != nil || err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Run = %v, %v; want nil report and %q", rep, err, tt.wantErr)
			}
		})
	}
}

func TestRunCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var progress bytes.Buffer
	opts := fakeOptions(&progress)
	opts.Workloads = []string{"tcp_rr"}
	opts.CellDuration = 5 * time.Second
	time.AfterFunc(500*time.Millisecond, cancel)
	start := time.Now()
	rep, err := Run(ctx, &fakeLab{mode: "overlay"}, opts)
	if !errors.Is(err, context.Canceled) || rep == nil {
		t.Fatalf("Run = %v, %v; want a partial report and context.Canceled", rep, err)
	}
	if elapsed := time.Since(start); elapsed > 4*time.Second {
		t.Errorf("cancel took %s", elapsed)
	}
	assertNoServersLeft(t)
}

// frontLab puts a front before h1's servers and lets them listen on two
// port blocks only; it records every command's argv.
type frontLab struct {
	fakeLab
	argv []string
}

func (l *frontLab) Front(target string) (netip.Addr, bool) {
	return netip.MustParseAddr("127.0.0.7"), target == "h1"
}

func (l *frontLab) PortBlocks() int { return 2 }

func (l *frontLab) Command(ctx context.Context, target, name string, args ...string) (*exec.Cmd, error) {
	if name != "grep" {
		l.argv = append(l.argv, strings.Join(append([]string{filepath.Base(name)}, args...), " "))
	}
	return l.fakeLab.Command(ctx, target, name, args...)
}

// TestRunFrontAndPortBlocks: the servers of a lab with a front bind their
// own address and the clients dial the front's (nothing listens there: the
// cells fail); the cells take their ports from the lab's two blocks.
func TestRunFrontAndPortBlocks(t *testing.T) {
	opts := fakeOptions(&bytes.Buffer{})
	opts.Modes = []string{"host"}
	opts.Workloads = []string{"tcp_rr"}
	opts.Repeat = 3
	l := &frontLab{fakeLab: fakeLab{mode: "overlay"}}
	rep, err := Run(context.Background(), l, opts)
	if !errors.Is(err, ErrIncomplete) || len(rep.Failures) != 3 {
		t.Fatalf("Run = %v; failures %+v", err, rep.Failures)
	}
	self := filepath.Base(os.Args[0])
	var want []string
	for _, port := range []string{"25300", "25304", "25300"} {
		want = append(want, self+" server --bind 127.0.0.1 --port "+port,
			self+" client --test tcp_rr --host 127.0.0.7 --port "+port+" --duration 0.15") // the warm-up, which fails
	}
	if !slices.Equal(l.argv, want) {
		t.Errorf("commands:\n got %q\nwant %q", l.argv, want)
	}
	assertNoServersLeft(t)
}

// sickeningLab is healthy for its first check only.
type sickeningLab struct {
	fakeLab
	checks int
}

func (l *sickeningLab) Healthy(context.Context) error {
	l.checks++
	if l.checks > 1 {
		return errors.New("agent h2 stopped")
	}
	return nil
}

func TestRunStopsWhenLabTurnsUnhealthy(t *testing.T) {
	Modes["broken"] = Mode{Name: "broken", LabMode: "overlay", Placement: ContainerPlacement,
		Wrap: func(cmd *exec.Cmd) { SetEnv(cmd, "SKIFF_BENCH_FAKE_FAIL", "1") }}
	t.Cleanup(func() { delete(Modes, "broken") })
	opts := fakeOptions(&bytes.Buffer{})
	opts.Modes = []string{"host", "broken"}
	opts.Workloads = []string{"tcp_rr", "connect"}
	rep, err := Run(context.Background(), &sickeningLab{fakeLab: fakeLab{mode: "overlay"}}, opts)
	if rep == nil || err == nil || !strings.Contains(err.Error(), "lab became unhealthy: agent h2 stopped") {
		t.Fatalf("Run = %v, %v", rep, err)
	}
	if len(rep.Failures) != 1 || !strings.Contains(rep.Failures[0].Error, "(lab unhealthy: agent h2 stopped)") {
		t.Errorf("failures = %+v", rep.Failures)
	}
	if res, _ := rep.find("connect", "host", "p50"); res.Median != nil {
		t.Errorf("cells after the stop were run: %+v", res)
	}
	assertNoServersLeft(t)
}

// assertNoServersLeft checks that every process Run started has exited:
// the fake lab starts them as direct children of the test process.
func assertNoServersLeft(t *testing.T) {
	t.Helper()
	stats, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		t.Fatal(err)
	}
	self := strconv.Itoa(os.Getpid())
	for _, path := range stats {
		data, err := os.ReadFile(path)
		if err != nil {
			continue // exited meanwhile
		}
		// pid (comm) state ppid ...: comm may contain spaces, so split after ')'.
		fields := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+1:]))
		if len(fields) > 1 && fields[1] == self {
			t.Errorf("child process still running after Run: %s", strings.TrimSpace(string(data[:min(len(data), 80)])))
		}
	}
}

// --- fake skiff-perf --------------------------------------------------------

func fakePerf(args []string) int {
	if len(args) == 0 {
		return 64
	}
	fs := flag.NewFlagSet("skiff-perf", flag.ContinueOnError)
	bind := fs.String("bind", "", "")
	host := fs.String("host", "", "")
	port := fs.Int("port", 0, "")
	test := fs.String("test", "", "")
	duration := fs.Float64("duration", 1, "")
	count := fs.Int("count", 100, "")
	if err := fs.Parse(args[1:]); err != nil {
		return 64
	}
	switch args[0] {
	case "server":
		return fakeServer(*bind, *port)
	case "client":
		return fakeClient(*test, *host, *port, time.Duration(*duration*float64(time.Second)), *count)
	}
	return 64
}

func fakeServer(ip string, port int) int {
	rr, err1 := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
	conn, err2 := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(port+1)))
	udp, err3 := net.ListenPacket("udp", net.JoinHostPort(ip, strconv.Itoa(port)))
	if err := errors.Join(err1, err2, err3); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	go acceptLoop(rr, echo)
	go acceptLoop(conn, func(c net.Conn) { c.Close() })
	buf := make([]byte, 2048)
	for {
		n, addr, err := udp.ReadFrom(buf)
		if err != nil {
			return 1
		}
		udp.WriteTo(buf[:n], addr)
	}
}

func acceptLoop(l net.Listener, serve func(net.Conn)) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go serve(c)
	}
}

func echo(c net.Conn) {
	defer c.Close()
	buf := make([]byte, 64)
	for {
		n, err := c.Read(buf)
		if err != nil {
			return
		}
		if _, err := c.Write(buf[:n]); err != nil {
			return
		}
	}
}

func fakeClient(test, host string, port int, d time.Duration, count int) int {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	var lat []time.Duration
	var err error
	start := time.Now()
	switch test {
	case "tcp_rr", "udp_rr":
		lat, err = pingPong(test[:3], addr, d, false)
	case "tcp_crr":
		lat, err = pingPong("tcp", addr, d, true)
	case "connect":
		lat, err = connects(net.JoinHostPort(host, strconv.Itoa(port+1)), count)
	default:
		return 64
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	errs := 0
	if os.Getenv("SKIFF_BENCH_FAKE_FAIL") == "1" {
		errs = 3
	}
	printPerfJSON(test, lat, errs, time.Since(start))
	if errs > 0 {
		return 2
	}
	return 0
}

func pingPong(network, addr string, d time.Duration, reconnect bool) ([]time.Duration, error) {
	var lat []time.Duration
	var c net.Conn
	defer func() {
		if c != nil {
			c.Close()
		}
	}()
	buf := make([]byte, 1)
	for end := time.Now().Add(d); time.Now().Before(end); {
		t0 := time.Now()
		if c == nil {
			var err error
			if c, err = net.Dial(network, addr); err != nil {
				return nil, err
			}
		}
		c.SetDeadline(time.Now().Add(time.Second))
		if _, err := c.Write([]byte{'x'}); err != nil {
			return nil, err
		}
		if _, err := c.Read(buf); err != nil {
			return nil, err
		}
		lat = append(lat, time.Since(t0))
		if reconnect {
			c.Close()
			c = nil
		}
	}
	return lat, nil
}

func connects(addr string, count int) ([]time.Duration, error) {
	var lat []time.Duration
	for range count {
		t0 := time.Now()
		c, err := net.Dial("tcp", addr)
		if err != nil {
			return nil, err
		}
		lat = append(lat, time.Since(t0))
		c.Close()
	}
	return lat, nil
}

func printPerfJSON(test string, lat []time.Duration, errs int, elapsed time.Duration) {
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds()) / 1e3
	}
	out := map[string]any{
		"test": test, "transactions": len(lat), "errors": errs, "lost": 0, "duration_s": elapsed.Seconds(),
		"rate": float64(len(lat)) / elapsed.Seconds(), "p50_us": pct(0.5), "p90_us": pct(0.9), "p99_us": pct(0.99),
		"p999_us": pct(0.999), "min_us": pct(0), "max_us": pct(1), "mean_us": pct(0.5),
	}
	line, _ := json.Marshal(out)
	fmt.Println(string(line))
}
