package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/skiffnet/skiff/bench"
	"github.com/skiffnet/skiff/lab"
)

func cmdBench(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "bench")
	modes := fs.String("modes", "host,overlay", "comma-separated modes: "+strings.Join(bench.ModeNames(), ", "))
	workloads := fs.String("workloads", "", "comma-separated workloads (default: all; with --quick the micro set): "+strings.Join(bench.WorkloadNames(false), ", "))
	repeat := fs.Int("repeat", 0, "repetitions of every cell (default 3; 1 with --quick)")
	quick := fs.Bool("quick", false, "short cells on the micro workloads (CI smoke, about a minute)")
	sameHost := fs.Bool("same-host", false, "client and server on one host instead of two")
	cell := fs.Duration("cell", 0, "duration of each cell (default 10s; 2s with --quick)")
	labName := fs.String("lab", "bench", "lab to run on; brought up (and down afterwards) if not running")
	jsonOut := fs.String("json", "", "write the results as JSON (schema skiff-bench/v1) to FILE")
	mdOut := fs.String("markdown", "", "write a Markdown table to FILE")
	svgOut := fs.String("chart", "", "write an SVG bar chart of ratios to host to FILE")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	opts := bench.Options{Modes: splitComma(*modes), Workloads: splitComma(*workloads), Repeat: *repeat,
		Quick: *quick, SameHost: *sameHost, CellDuration: *cell, Progress: env.Stderr}
	labMode, err := labModeFor(opts.Modes)
	if err != nil {
		return usageError{err}
	}
	ctx, stop := signalContext(ctx)
	defer stop()
	l, err := lab.Open(*labName)
	if err == nil && l.Mode() != labMode {
		return fmt.Errorf("lab %s runs mode %s, these modes need %s (skiff lab down --name %s)", *labName, l.Mode(), labMode, *labName)
	}
	if err != nil {
		fmt.Fprintf(env.Stderr, "bringing up lab %s (mode %s) for the benchmark\n", *labName, labMode)
		if l, err = lab.Up(ctx, lab.Config{Name: *labName, Hosts: 2, ContainersPerHost: 2, Mode: labMode}); err != nil {
			return err
		}
		defer func() {
			if err := lab.Down(context.WithoutCancel(ctx), *labName); err != nil {
				fmt.Fprintln(env.Stderr, "skiff: lab down:", err)
			}
		}()
	}
	start := time.Now()
	report, runErr := bench.Run(ctx, l, opts)
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
	return errors.Join(runErr, err)
}

// labModeFor returns the single lab data-plane mode that can carry modes.
func labModeFor(modes []string) (string, error) {
	need := ""
	for _, name := range modes {
		m, ok := bench.Modes[name]
		if !ok {
			return "", fmt.Errorf("unknown mode %q (modes: %s)", name, strings.Join(bench.ModeNames(), ", "))
		}
		if m.LabMode != "" && need != "" && m.LabMode != need {
			return "", fmt.Errorf("modes %v need different labs (%s and %s): run them separately", modes, need, m.LabMode)
		}
		if m.LabMode != "" {
			need = m.LabMode
		}
	}
	if need == "" {
		need = "overlay"
	}
	return need, nil
}

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

func splitComma(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
