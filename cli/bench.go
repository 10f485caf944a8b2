package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/skiffnet/skiff/agent"
	"github.com/skiffnet/skiff/bench"
	"github.com/skiffnet/skiff/bench/scale"
	"github.com/skiffnet/skiff/lab"
	"github.com/skiffnet/skiff/layer"
)

// What a run measures unless told: the baseline, the standard overlay,
// the cache, and auto as preloaded programs and as unmodified images run
// in it (what users run); the CI smoke only the first two.
const (
	defaultModes = "host,overlay,cache,auto,auto-plain"
	quickModes   = "host,overlay"
)

// benchLayers makes every registered layer a bench mode of its name (its
// containers, in a lab of that mode), unless the bench has one already:
// a new layer is measured alone without an entry in bench.Modes.
func benchLayers() {
	for _, name := range agent.Modes() {
		if _, ok := bench.Modes[name]; !ok && name != layer.Auto {
			bench.Modes[name] = bench.Mode{Name: name, LabMode: name, Placement: bench.ContainerPlacement,
				Description: "containers in a lab of the " + name + " layer alone", Explicit: true}
		}
	}
}

func cmdBench(ctx context.Context, env Env, args []string) error {
	benchLayers()
	fs := flags(env, "bench")
	modes := fs.String("modes", "", "comma-separated modes (default "+defaultModes+"; with --quick "+quickModes+"): "+strings.Join(bench.ModeNames(), ", "))
	workloads := fs.String("workloads", "", "comma-separated workloads (default: all; with --quick the micro set): "+strings.Join(bench.WorkloadNames(false), ", "))
	repeat := fs.Int("repeat", 0, "repetitions of every cell (default 3; 1 with --quick)")
	quick := fs.Bool("quick", false, "short cells on the micro workloads (CI smoke, about a minute)")
	sameHost := fs.Bool("same-host", false, "client and server on one host instead of two")
	cell := fs.Duration("cell", 0, "duration of each cell (default 10s; 2s with --quick)")
	labName := fs.String("lab", "", "a running lab to use for its mode; other modes get labs b<mode>, brought up and down for the run")
	jsonOut := fs.String("json", "", "write the results as JSON (schema skiff-bench/v1) to FILE")
	mdOut := fs.String("markdown", "", "write a Markdown table to FILE")
	svgOut := fs.String("chart", "", "write an SVG bar chart of ratios to host to FILE")
	check := fs.Bool("check", false, "judge the run against the regression floors (auto against host and its parts; make bench-check) and fail when one is missed")
	scaleRun := fs.Bool("scale", false, "measure how the cost grows instead (make scale): pod bursts, hosts, policy rules, concurrent flows, each on a lab of its own")
	scaleParts := fs.String("scale-parts", "", "with --scale, comma-separated parts (default all): "+strings.Join(scale.Parts, ", "))
	scaleSmall := fs.Bool("scale-small", false, "with --scale, the smallest sizes of every part (a smoke run)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	if *scaleRun {
		if *modes != "" || *workloads != "" || *quick || *sameHost || *labName != "" || *check {
			return usagef("--scale brings up labs of its own in auto: no --modes, --workloads, --quick, --same-host, --lab or --check")
		}
		opts := scale.Full
		if *scaleSmall {
			opts = scale.Small
		}
		opts.Parts, opts.Progress = layer.SplitList(*scaleParts), env.Stderr
		if *repeat > 0 {
			opts.Repeat = *repeat
		}
		if *cell > 0 {
			opts.Cell = *cell
		}
		return runScale(ctx, env, opts, *jsonOut, *mdOut, *svgOut)
	} else if *scaleParts != "" || *scaleSmall {
		return usagef("--scale-parts and --scale-small go with --scale")
	}
	if *modes == "" {
		*modes = defaultModes
		if *quick {
			*modes = quickModes
		}
	}
	opts := bench.Options{Modes: layer.SplitList(*modes), Workloads: layer.SplitList(*workloads), Repeat: *repeat,
		Quick: *quick, SameHost: *sameHost, CellDuration: *cell, Progress: env.Stderr}
	labModes, err := labModesFor(opts.Modes)
	if err != nil {
		return usageError{err}
	}
	ctx, stop := signalContext(ctx)
	defer stop()
	labs := labSet{labs: map[string]*lab.Lab{}}
	defer labs.downStarted(env)
	for _, key := range labModes {
		want := labOf(key)
		mode, args := want.Mode, want.AgentArgs
		name := benchLabName(key)
		fits := func(l *lab.Lab) bool {
			return l.Mode() == mode && slices.Equal(l.Config.AgentArgs, args) && l.Config.SlimRouters == want.SlimRouters
		}
		if l, err := lab.Open(*labName); err == nil && fits(l) {
			name = *labName
		}
		l, err := lab.Open(name)
		if err == nil && !fits(l) {
			return fmt.Errorf("lab %s runs mode %s %v, the benchmark needs %s %v there (skiff lab down --name %s)", name, l.Mode(), l.Config.AgentArgs, mode, args, name)
		}
		if err != nil {
			fmt.Fprintf(env.Stderr, "bringing up lab %s (mode %s %v) for the benchmark\n", name, mode, args)
			if l, err = lab.Up(ctx, lab.Config{Name: name, Hosts: 2, ContainersPerHost: 2, Mode: mode, AgentArgs: args, SlimRouters: want.SlimRouters}); err != nil {
				return err
			}
			labs.started = append(labs.started, name)
		}
		labs.add(key, l)
	}
	start := time.Now()
	report, runErr := bench.Run(ctx, labs.bench(), opts)
	if report == nil {
		return runErr
	}
	err = errors.Join(
		report.WriteTable(env.Stdout),
		writeFile(*jsonOut, report.WriteJSON),
		writeFile(*mdOut, report.WriteMarkdown),
		writeFile(*svgOut, report.WriteSVG),
	)
	fmt.Fprintf(env.Stderr, "benchmark took %s\n", time.Since(start).Round(time.Second))
	if *check {
		fmt.Fprintln(env.Stdout)
		failed, werr := bench.WriteCheck(env.Stdout, report.Check())
		err = errors.Join(err, werr)
		if failed > 0 {
			err = errors.Join(err, fmt.Errorf("%d regression floors missed", failed))
		}
	}
	return errors.Join(runErr, err)
}

// labModesFor returns the lab data-plane modes the benchmark modes need, in
// order; host runs in the first. A mode on the hosts of its own lab
// (host-sockets) is there to be compared with host on a lab without its
// layer, so an overlay lab comes first then.
func labModesFor(modes []string) ([]string, error) {
	var out []string
	onHosts := ""
	for _, name := range modes {
		m, ok := bench.Modes[name]
		if !ok {
			return nil, fmt.Errorf("unknown mode %q (modes: %s)", name, strings.Join(bench.ModeNames(), ", "))
		}
		if m.LabMode != "" && !slices.Contains(out, m.Lab()) {
			out = append(out, m.Lab())
		}
		if m.LabMode != "" && m.Placement == bench.HostPlacement {
			onHosts = m.Lab()
		}
	}
	if len(out) == 0 || out[0] == onHosts {
		out = slices.Insert(slices.DeleteFunc(out, func(m string) bool { return m == "overlay" }), 0, "overlay")
	}
	return out, nil
}

// labSet runs one lab per data-plane mode side by side, so every mode is
// measured in one interleaved run. Targets are qualified by mode
// ("cache:h1/c1"); unqualified ones (host mode) go to the first lab.
type labSet struct {
	labs    map[string]*lab.Lab
	order   []string
	started []string // labs this command brought up, to take down
}

func (s *labSet) add(mode string, l *lab.Lab) {
	s.labs[mode] = l
	s.order = append(s.order, mode)
}

func (s *labSet) downStarted(env Env) {
	for _, name := range s.started {
		if err := lab.Down(context.Background(), name); err != nil {
			fmt.Fprintln(env.Stderr, "skiff: lab down:", err)
		}
	}
}

// labOf is the lab (its mode, skiffd flags, routers) of key (Mode.Lab).
func labOf(key string) lab.Config {
	for _, m := range bench.Modes {
		if m.Lab() == key {
			return lab.Config{Mode: m.LabMode, AgentArgs: m.LabArgs, SlimRouters: m.LabSlim}
		}
	}
	return lab.Config{Mode: key}
}

// benchLabName names the lab of key, in at most 8 characters: a
// variant's name keeps its variant ("boveslim", not "boverlay").
func benchLabName(key string) string {
	name := "b" + key
	if len(name) <= 8 {
		return name
	}
	for _, m := range bench.Modes {
		if m.Lab() == key && m.LabVariant != "" && len(m.LabVariant) < 7 {
			return "b" + m.LabMode[:min(len(m.LabMode), 7-len(m.LabVariant))] + m.LabVariant
		}
	}
	return name[:8]
}

// bench returns the lab itself when there is one of its mode, else the set.
func (s *labSet) bench() bench.Lab {
	if len(s.order) == 1 && s.labs[s.order[0]].Mode() == s.order[0] {
		return s.labs[s.order[0]]
	}
	return s
}

func (s *labSet) pick(target string) (*lab.Lab, string) {
	if mode, t, ok := strings.Cut(target, ":"); ok {
		if l, ok := s.labs[mode]; ok {
			return l, t
		}
	}
	return s.labs[s.order[0]], target
}

func (s *labSet) IP(target string) (netip.Addr, error) {
	l, t := s.pick(target)
	return l.IP(t)
}

func (s *labSet) Command(ctx context.Context, target, name string, args ...string) (*exec.Cmd, error) {
	l, t := s.pick(target)
	return l.Command(ctx, t, name, args...)
}

func (s *labSet) SeccompCommand(ctx context.Context, target, name string, args ...string) (*exec.Cmd, error) {
	l, t := s.pick(target)
	return l.SeccompCommand(ctx, t, name, args...)
}

func (s *labSet) Listening(ctx context.Context, target string) ([]netip.AddrPort, error) {
	l, t := s.pick(target)
	return l.Listening(ctx, t)
}

func (s *labSet) ListeningUDP(ctx context.Context, target string) ([]netip.AddrPort, error) {
	l, t := s.pick(target)
	return l.ListeningUDP(ctx, t)
}

func (s *labSet) Healthy(ctx context.Context) error {
	var errs []error
	for _, m := range s.order {
		errs = append(errs, s.labs[m].Healthy(ctx))
	}
	return errors.Join(errs...)
}

func (s *labSet) FlushConntrack() error {
	var errs []error
	for _, m := range s.order {
		errs = append(errs, s.labs[m].FlushConntrack())
	}
	return errors.Join(errs...)
}

func (s *labSet) Mode() string { return strings.Join(s.order, "+") }

func writeFile(path string, write func(io.Writer) error) error {
	if path == "" {
		return nil
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

// runScale runs skiff bench --scale and writes what it measured, also
// when a part failed.
func runScale(ctx context.Context, env Env, opts scale.Options, jsonOut, mdOut, svgOut string) error {
	ctx, stop := signalContext(ctx)
	defer stop()
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	opts.BinDir = filepath.Dir(exe)
	report, runErr := scale.Run(ctx, opts)
	if report == nil {
		return runErr
	}
	return errors.Join(runErr,
		report.WriteMarkdown(env.Stdout),
		writeFile(jsonOut, report.WriteJSON),
		writeFile(mdOut, report.WriteMarkdown),
		writeFile(svgOut, report.WriteSVG))
}
