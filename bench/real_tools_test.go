package bench

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestRealToolsLoopback runs every workload whose tools are installed with
// the real iperf3, skiff-perf, memcached, nginx and wrk, all targets mapped
// to 127.0.0.1. Opt-in (about a minute): SKIFF_BENCH_REAL=1, with
// SKIFF_PERF_BIN=/path/to/skiff-perf for the skiff-perf workloads and
// SKIFF_BENCH_OUT=DIR to keep the table, Markdown, JSON and SVG outputs.
func TestRealToolsLoopback(t *testing.T) {
	if os.Getenv("SKIFF_BENCH_REAL") != "1" {
		t.Skip("set SKIFF_BENCH_REAL=1 to run the real tools on loopback")
	}
	perfBin := os.Getenv("SKIFF_PERF_BIN")
	var names []string
	for _, w := range workloads {
		if toolsInstalled(w, perfBin) {
			names = append(names, w.Name)
		}
	}
	if len(names) == 0 {
		t.Skip("no workload has its tools installed")
	}
	var progress bytes.Buffer
	opts := Options{
		Workloads: names, Repeat: 1, CellDuration: 2 * time.Second, ConnectCount: 2000,
		PerfBin: perfBin, Progress: &progress,
	}
	rep, err := Run(context.Background(), &realLab{}, opts)
	t.Logf("progress:\n%s", progress.String())
	if rep == nil {
		t.Fatal(err)
	}
	outputs := writeAll(t, rep)
	t.Logf("table:\n%s", outputs["table.txt"])
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if err := ValidateJSON(outputs["report.json"]); err != nil {
		t.Fatal(err)
	}
}

// realLab runs commands unmodified on this machine, every target on loopback.
type realLab struct{ fakeLab }

func (l *realLab) Command(ctx context.Context, target, name string, args ...string) (*exec.Cmd, error) {
	if _, err := l.IP(target); err != nil {
		return nil, err
	}
	return exec.CommandContext(ctx, name, args...), nil
}

func (l *realLab) Mode() string { return "overlay" }

func toolsInstalled(w *workload, perfBin string) bool {
	for _, tool := range w.Tools {
		if _, err := findTool(tool, perfBin); err != nil || (tool == toolPerf && perfBin == "") {
			return false
		}
	}
	return true
}

// writeAll renders every output format, keeping them in SKIFF_BENCH_OUT if set.
func writeAll(t *testing.T, rep *Report) map[string][]byte {
	t.Helper()
	writers := map[string]func(*bytes.Buffer) error{
		"table.txt":   func(b *bytes.Buffer) error { return rep.WriteTable(b) },
		"report.md":   func(b *bytes.Buffer) error { return rep.WriteMarkdown(b) },
		"report.json": func(b *bytes.Buffer) error { return rep.WriteJSON(b) },
		"chart.svg":   func(b *bytes.Buffer) error { return rep.WriteSVG(b) },
	}
	out := map[string][]byte{}
	dir := os.Getenv("SKIFF_BENCH_OUT")
	for name, write := range writers {
		var b bytes.Buffer
		if err := write(&b); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = b.Bytes()
		if dir != "" {
			if err := os.WriteFile(filepath.Join(dir, name), b.Bytes(), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	return out
}
