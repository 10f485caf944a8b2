package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/skiffnet/skiff/version"
)

// Lab is the emulated cluster the benchmark runs on. Targets: "h1" (a host
// namespace) or "h1/c1" (a container).
type Lab interface {
	// IP returns a container's overlay address or a host's underlay address.
	IP(target string) (netip.Addr, error)
	// Command returns a command that runs name with args inside target's network namespace.
	Command(ctx context.Context, target string, name string, args ...string) (*exec.Cmd, error)
	// Healthy returns an error when the lab cannot carry traffic (agents down, etc.).
	Healthy(ctx context.Context) error
	// Mode is the data-plane mode the lab was brought up in ("overlay", later "cache", ...).
	Mode() string
}

// SeccompLab is a Lab that also runs commands without the socket shim,
// under skiff's seccomp filter (modes with Seccomp).
type SeccompLab interface {
	SeccompCommand(ctx context.Context, target string, name string, args ...string) (*exec.Cmd, error)
}

// ConntrackLab is a Lab whose connection-tracking state can be reset: every
// cell then starts from empty tables, as it starts its own server.
type ConntrackLab interface {
	Lab
	FlushConntrack() error
}

// Options selects what Run measures. Zero values pick the profile defaults.
type Options struct {
	Modes        []string      // default: host + every mode made for the lab's mode
	Workloads    []string      // default: WorkloadNames(Quick)
	Repeat       int           // 0 = profile default (quick 1, full 3)
	SameHost     bool          // server and client on one host
	Quick        bool          // CI smoke profile
	CellDuration time.Duration // 0 = profile default (quick 2s, full 10s)
	ConnectCount int           // connections of the connect test; 0 = profile default
	PerfBin      string        // skiff-perf path; "" = next to the executable, else $PATH
	Progress     io.Writer     // progress lines (stderr); nil = none
}

// ErrIncomplete is returned (wrapped, with a non-nil Report) when at least one
// (workload, mode) cell has no successful sample.
var ErrIncomplete = errors.New("some benchmark cells have no successful sample")

// profile holds the defaults of the quick and full runs.
type profile struct {
	Name         string
	Cell         time.Duration
	Warmup       time.Duration
	Repeat       int
	ConnectCount int
}

var (
	quickProfile = profile{Name: ProfileQuick, Cell: 2 * time.Second, Warmup: time.Second, Repeat: 1, ConnectCount: 2000}
	fullProfile  = profile{Name: ProfileFull, Cell: 10 * time.Second, Warmup: 2 * time.Second, Repeat: 3, ConnectCount: 10000}
)

const (
	// BasePort is the first port servers listen on; each cell takes the next
	// free block of PortStride ports (see pickPort).
	BasePort   = 25300
	PortStride = 4
	portBlocks = 500
	// cellOverhead is the estimated cost of starting and stopping a server.
	cellOverhead = time.Second
)

// cell is one measurement: a workload in a mode in one repetition.
type cell struct {
	Rep      int // 1-based
	Workload *workload
	Mode     Mode
}

// planCells orders the cells so that modes interleave within each
// repetition: for rep, for workload, for mode; every other repetition runs
// the modes in reverse (A B C, then C B A). A cell inherits the state the one
// before it left (a crr cell leaves a minute of TIME_WAIT sockets behind), so
// a fixed order would hand every mode the same neighbour in every repetition.
func planCells(ws []*workload, modes []Mode, repeat int) []cell {
	var cells []cell
	reversed := slices.Clone(modes)
	slices.Reverse(reversed)
	for rep := 1; rep <= repeat; rep++ {
		order := modes
		if rep%2 == 0 {
			order = reversed
		}
		for _, w := range ws {
			for _, m := range order {
				cells = append(cells, cell{Rep: rep, Workload: w, Mode: m})
			}
		}
	}
	return cells
}

// runner carries the resolved configuration of one Run.
type runner struct {
	lab       Lab
	opts      Options
	prof      profile
	duration  time.Duration
	warmup    time.Duration
	connects  int
	repeat    int
	modes     []Mode
	workloads []*workload
	tools     map[string]string
	ends      map[string]Endpoints  // by mode name
	serverIP  map[string]netip.Addr // by mode name
	dialIP    map[string]netip.Addr // by mode name: serverIP or its front
	progress  io.Writer
	outcomes  map[cellKey]*cellOutcome
	failures  []Failure
	nextBlock int // port block the next cell tries first
}

type cellKey struct{ workload, mode string }

// cellOutcome collects the successful samples of a (workload, mode) in rep order.
type cellOutcome struct {
	Samples []sample
	CPU     []float64 // CPU per unit of work, one per sample
}

// Run measures every requested mode × workload on lab and returns the report.
// It refuses to start when the options are invalid, a tool is missing, or the
// lab is unhealthy or in the wrong mode (nil Report). When the report is
// non-nil it is complete enough to write even if err != nil: err wraps
// ErrIncomplete when a cell has no successful sample, or says why the run
// stopped early (context cancelled, lab became unhealthy).
func Run(ctx context.Context, lab Lab, opts Options) (*Report, error) {
	r, err := newRunner(lab, opts)
	if err != nil {
		return nil, err
	}
	if err := lab.Healthy(ctx); err != nil {
		return nil, fmt.Errorf("lab is not healthy, refusing to benchmark: %w", err)
	}
	if err := r.resolveTargets(); err != nil {
		return nil, err
	}
	return r.run(ctx)
}

func newRunner(lab Lab, opts Options) (*runner, error) {
	if opts.Repeat < 0 || opts.CellDuration < 0 || opts.ConnectCount < 0 {
		return nil, errors.New("bench options: repeat, cell duration and connect count must not be negative")
	}
	r := &runner{lab: lab, opts: opts, prof: fullProfile, progress: opts.Progress, outcomes: map[cellKey]*cellOutcome{}}
	if opts.Quick {
		r.prof = quickProfile
	}
	if r.progress == nil {
		r.progress = io.Discard
	}
	r.duration = cmp.Or(opts.CellDuration, r.prof.Cell)
	r.warmup = min(r.prof.Warmup, r.duration/2)
	r.repeat = cmp.Or(opts.Repeat, r.prof.Repeat)
	r.connects = cmp.Or(opts.ConnectCount, r.prof.ConnectCount)
	var err error
	if r.modes, err = resolveModes(opts.Modes, lab.Mode()); err != nil {
		return nil, err
	}
	if r.workloads, err = resolveWorkloads(opts.Workloads, opts.Quick); err != nil {
		return nil, err
	}
	if r.tools, err = resolveTools(r.workloads, opts.PerfBin); err != nil {
		return nil, err
	}
	return r, nil
}

// resolveTools finds every binary the workloads need, listing all missing ones.
func resolveTools(ws []*workload, perfBin string) (map[string]string, error) {
	tools := map[string]string{}
	neededBy := map[string][]string{}
	for _, w := range ws {
		for _, t := range w.Tools {
			neededBy[t] = append(neededBy[t], w.Name)
		}
	}
	var missing []string
	for name, users := range neededBy {
		path, err := findTool(name, perfBin)
		if err != nil {
			missing = append(missing, fmt.Sprintf("%s (for %s: %v)", name, strings.Join(users, ", "), err))
			continue
		}
		tools[name] = path
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		return nil, fmt.Errorf("bench: missing tools: %s", strings.Join(missing, "; "))
	}
	return tools, nil
}

// findTool returns the absolute path of a tool. skiff-perf is taken from
// perfBin, else next to the running executable, else from $PATH.
func findTool(name, perfBin string) (string, error) {
	if name == toolPerf && perfBin != "" {
		if _, err := os.Stat(perfBin); err != nil {
			return "", err
		}
		return filepath.Abs(perfBin)
	}
	if name == toolPerf {
		if exe, err := os.Executable(); err == nil {
			candidate := filepath.Join(filepath.Dir(exe), toolPerf)
			if info, err := os.Stat(candidate); err == nil && !info.IsDir() {
				return candidate, nil
			}
		}
	}
	path, err := exec.LookPath(name)
	if err != nil {
		return "", err
	}
	return filepath.Abs(path)
}

// resolveTargets finds each mode's server and client and the server address.
func (r *runner) resolveTargets() error {
	r.ends = map[string]Endpoints{}
	r.serverIP = map[string]netip.Addr{}
	r.dialIP = map[string]netip.Addr{}
	for _, m := range r.modes {
		ends := m.targets(r.opts.SameHost, r.lab.Mode())
		ip, err := r.lab.IP(ends.Server)
		if err != nil {
			return fmt.Errorf("mode %s: address of server %s: %w", m.Name, ends.Server, err)
		}
		if _, err := r.lab.IP(ends.Client); err != nil {
			return fmt.Errorf("mode %s: client %s: %w", m.Name, ends.Client, err)
		}
		r.ends[m.Name] = ends
		r.serverIP[m.Name], r.dialIP[m.Name] = ip, ip
		if fl, ok := r.lab.(FrontLab); ok {
			if front, ok := fl.Front(ends.Server); ok {
				r.dialIP[m.Name] = front
			}
		}
	}
	return nil
}

func (r *runner) env(c cell, port int) cellEnv {
	return cellEnv{
		ServerIP: r.serverIP[c.Mode.Name], DialIP: r.dialIP[c.Mode.Name], Port: port,
		Duration: r.duration, Warmup: r.warmup, ConnectCount: r.connects, Tools: r.tools,
	}
}

// estimate is the expected wall time of a cell, overhead included.
func (r *runner) estimate(c cell) time.Duration {
	return c.Workload.Estimate(r.env(c, 0)) + cellOverhead
}

func (r *runner) run(ctx context.Context) (*Report, error) {
	start := time.Now()
	cells := planCells(r.workloads, r.modes, r.repeat)
	prog := newProgress(r.progress, cells, r.estimate)
	prog.header(r.describe(len(cells)))
	var stopErr error
	for i, c := range cells {
		prog.begin(i, c)
		s, cpu, err := r.runCell(ctx, c)
		if err == nil {
			r.record(c, s, cpu)
			prog.end(i, "ok "+summarizeSample(c.Workload, s))
			continue
		}
		prog.end(i, "FAILED: "+err.Error())
		if stopErr = r.afterFailure(ctx, c, err); stopErr != nil {
			break
		}
	}
	report := r.report(start)
	if stopErr != nil {
		return report, stopErr
	}
	return report, report.incomplete()
}

// afterFailure records a failed sample and decides whether to go on: the run
// stops when ctx is done or the lab is no longer healthy.
func (r *runner) afterFailure(ctx context.Context, c cell, err error) error {
	if ctx.Err() != nil {
		r.fail(c, err)
		return fmt.Errorf("benchmark interrupted: %w", ctx.Err())
	}
	if herr := r.lab.Healthy(ctx); herr != nil {
		r.fail(c, fmt.Errorf("%w (lab unhealthy: %v)", err, herr))
		return fmt.Errorf("benchmark stopped, lab became unhealthy: %w", herr)
	}
	r.fail(c, err)
	return nil
}

func (r *runner) describe(n int) string {
	placement := "cross-host"
	if r.opts.SameHost {
		placement = "same-host"
	}
	return fmt.Sprintf("%d modes × %d workloads × %d reps = %d cells (%s profile, %s cells, %s)",
		len(r.modes), len(r.workloads), r.repeat, n, r.prof.Name, r.duration, placement)
}

func (r *runner) record(c cell, s sample, cpu float64) {
	key := cellKey{c.Workload.Name, c.Mode.Name}
	o := r.outcomes[key]
	if o == nil {
		o = &cellOutcome{}
		r.outcomes[key] = o
	}
	s.Rep = c.Rep
	o.Samples = append(o.Samples, s)
	o.CPU = append(o.CPU, cpu)
}

func (r *runner) fail(c cell, err error) {
	r.failures = append(r.failures, Failure{Workload: c.Workload.Name, Mode: c.Mode.Name, Rep: c.Rep, Error: err.Error()})
}

// FrontLab is a Lab where clients may reach a server through a front (a
// Kubernetes Service's address): when Front(target) is ok, a server in
// target binds its own address and clients dial the front's.
type FrontLab interface {
	Front(target string) (netip.Addr, bool)
}

// PortLab is a Lab whose servers are reached on a few ports only (a
// Kubernetes Service's): cells take their ports from the first
// PortBlocks() blocks of PortStride ports from BasePort.
type PortLab interface {
	PortBlocks() int
}

// pickPort returns the first port of the next block whose ports are all free
// in target's namespace, so a cell never reuses its predecessor's sockets
// and the readiness probe never mistakes a stranger's socket for the server.
func (r *runner) pickPort(ctx context.Context, target string) (int, error) {
	open, err := openPorts(ctx, r.lab, target, true)
	if err != nil {
		return 0, err
	}
	blocks := portBlocks
	if pl, ok := r.lab.(PortLab); ok {
		blocks = min(blocks, pl.PortBlocks())
	}
	for range blocks {
		port := BasePort + r.nextBlock%blocks*PortStride
		r.nextBlock = (r.nextBlock + 1) % blocks
		if blockFree(open, port) {
			return port, nil
		}
	}
	return 0, fmt.Errorf("no free port block in %d..%d on %s", BasePort, BasePort+blocks*PortStride-1, target)
}

func blockFree(open map[listenPort]bool, port int) bool {
	for p := port; p < port+PortStride; p++ {
		if open[listenPort{"tcp", p}] || open[listenPort{"udp", p}] {
			return false
		}
	}
	return true
}

// runCell starts the server, runs the client (after an optional warm-up),
// stops the server and returns the sample with its CPU cost per unit of work.
func (r *runner) runCell(ctx context.Context, c cell) (sample, float64, error) {
	if cl, ok := r.lab.(ConntrackLab); ok {
		if err := cl.FlushConntrack(); err != nil {
			return sample{}, 0, err
		}
	}
	ends := r.ends[c.Mode.Name]
	port, err := r.pickPort(ctx, ends.Server)
	if err != nil {
		return sample{}, 0, err
	}
	env := r.env(c, port)
	spec, err := c.Workload.Server(env)
	if err != nil {
		return sample{}, 0, err
	}
	if spec.Cleanup != nil {
		defer spec.Cleanup()
	}
	srv, err := r.start(ctx, c.Mode, ends.Server, spec.Argv)
	if err != nil {
		return sample{}, 0, fmt.Errorf("server: %w", err)
	}
	defer srv.stop()
	if err := waitListening(ctx, r.lab, ends.Server, spec.Ready, srv); err != nil {
		return sample{}, 0, err
	}
	if srv.exited() {
		return sample{}, 0, fmt.Errorf("server exited after start: %s", srv.describeExit())
	}
	return r.measure(ctx, c, env, ends.Client)
}

// measure runs the warm-up and the recorded client run with CPU accounting.
func (r *runner) measure(ctx context.Context, c cell, env cellEnv, target string) (sample, float64, error) {
	client := c.Workload.Client(env)
	timeout := 2*r.estimate(c) + 30*time.Second
	if client.Warmup != nil {
		res, err := r.runClient(ctx, c.Mode, target, client.Warmup, timeout)
		if err == nil && res.ExitCode != 0 {
			// the workload's own reading of a failure says more
			if _, err = c.Workload.Parse(res); err == nil {
				err = withExit(errors.New("client failed"), res)
			}
		}
		if err != nil {
			return sample{}, 0, fmt.Errorf("warm-up: %w", err)
		}
	}
	before, err := BusyTicks()
	if err != nil {
		return sample{}, 0, err
	}
	res, err := r.runClient(ctx, c.Mode, target, client.Run, timeout)
	if err != nil {
		return sample{}, 0, fmt.Errorf("client: %w", err)
	}
	after, err := BusyTicks()
	if err != nil {
		return sample{}, 0, err
	}
	s, err := c.Workload.Parse(res)
	if err != nil {
		return sample{}, 0, err
	}
	return s, busySeconds(before, after) / s.Work * c.Workload.cpuScale(), nil
}

// command builds argv in target's namespace, wrapped by the mode.
func (r *runner) command(ctx context.Context, m Mode, target string, argv []string) (*exec.Cmd, error) {
	run := r.lab.Command
	if m.Seccomp {
		sl, ok := r.lab.(SeccompLab)
		if !ok {
			return nil, fmt.Errorf("mode %s needs a lab that runs commands under the seccomp filter", m.Name)
		}
		run = sl.SeccompCommand
	}
	cmd, err := run(ctx, target, argv[0], argv[1:]...)
	if err != nil {
		return nil, fmt.Errorf("command in %s: %w", target, err)
	}
	if m.Wrap != nil {
		m.Wrap(cmd)
	}
	return cmd, nil
}

func (r *runner) start(ctx context.Context, m Mode, target string, argv []string) (*process, error) {
	cmd, err := r.command(ctx, m, target, argv)
	if err != nil {
		return nil, err
	}
	return startProcess(cmd)
}

func (r *runner) runClient(ctx context.Context, m Mode, target string, argv []string, timeout time.Duration) (commandResult, error) {
	cmd, err := r.command(ctx, m, target, argv)
	if err != nil {
		return commandResult{}, err
	}
	return runCommand(ctx, cmd, timeout)
}

// summarizeSample is the primary metric of a sample for progress lines.
func summarizeSample(w *workload, s sample) string {
	m := w.Metrics[0]
	return fmt.Sprintf("%s %s %s", m.Name, formatValue(s.Values[m.Name]), m.Unit)
}

// report builds the Report from the outcomes gathered so far.
func (r *runner) report(start time.Time) *Report {
	rep := &Report{
		Schema:  SchemaVersion,
		Machine: collectMachine(start),
		Config: Config{
			Repeat: r.repeat, SameHost: r.opts.SameHost, Profile: r.prof.Name,
			CellSeconds: r.duration.Seconds(), ConnectCount: r.connects, LabMode: r.lab.Mode(),
			Commit: version.Commit(),
		},
		Results:  []Result{},
		Failures: append([]Failure{}, r.failures...),
	}
	for _, m := range r.modes {
		rep.Config.Modes = append(rep.Config.Modes, m.Name)
	}
	for _, w := range r.workloads {
		rep.Config.Workloads = append(rep.Config.Workloads, w.Name)
		for _, metric := range w.Metrics {
			rep.Results = append(rep.Results, r.metricResults(w, metric)...)
		}
	}
	return rep
}

// metricResults summarises one metric of a workload for every mode.
func (r *runner) metricResults(w *workload, metric metricDef) []Result {
	host, hostOK := summarize(r.values(w.Name, HostMode, metric.Name))
	hostByRep := r.byRep(w.Name, HostMode, metric.Name)
	var rows []Result
	for _, m := range r.modes {
		values := r.values(w.Name, m.Name, metric.Name)
		row := Result{
			Workload: w.Name, Mode: m.Name, Metric: metric.Name, Unit: metric.Unit, Better: metric.Better,
			Samples: append([]float64{}, values...), CPUUnit: w.CPUUnit,
		}
		if s, ok := summarize(values); ok {
			row.Median, row.Min, row.Max = ptr(s.Median), ptr(s.Min), ptr(s.Max)
			if q, ok := ratio(s.Median, host.Median); ok && hostOK {
				row.RatioToHost = ptr(q)
			}
			if m.Name != HostMode {
				if p, ok := pairedRatio(r.byRep(w.Name, m.Name, metric.Name), hostByRep); ok {
					row.Paired = &p
				}
			}
		}
		if o := r.outcomes[cellKey{w.Name, m.Name}]; o != nil {
			if s, ok := summarize(o.CPU); ok {
				row.CPUPerUnit = ptr(s.Median)
			}
		}
		rows = append(rows, row)
	}
	return rows
}

func (r *runner) values(workload, mode, metric string) []float64 {
	o := r.outcomes[cellKey{workload, mode}]
	if o == nil {
		return nil
	}
	var v []float64
	for _, s := range o.Samples {
		v = append(v, s.Values[metric])
	}
	return v
}

// byRep is values keyed by repetition.
func (r *runner) byRep(workload, mode, metric string) map[int]float64 {
	v := map[int]float64{}
	if o := r.outcomes[cellKey{workload, mode}]; o != nil {
		for _, s := range o.Samples {
			v[s.Rep] = s.Values[metric]
		}
	}
	return v
}

func ptr(v float64) *float64 { return &v }

// incomplete returns an ErrIncomplete error naming the cells without a
// median, or nil.
func (r *Report) incomplete() error {
	var empty []string
	seen := map[cellKey]bool{}
	for _, res := range r.Results {
		key := cellKey{res.Workload, res.Mode}
		if res.Median == nil && !seen[key] {
			seen[key] = true
			empty = append(empty, res.Workload+"/"+res.Mode)
		}
	}
	if len(empty) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s (see failures)", ErrIncomplete, strings.Join(empty, ", "))
}
