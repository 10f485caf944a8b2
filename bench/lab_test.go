package bench_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/skiffnet/skiff/bench"
	"github.com/skiffnet/skiff/lab"
	"github.com/skiffnet/skiff/lab/labtest"
)

// TestQuickBenchOnLab runs the quick profile on a real lab, as make run and
// CI do, and checks the JSON against the schema (not against speed).
func TestQuickBenchOnLab(t *testing.T) {
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root and the lab")
	}
	bin := labtest.BinDir(t, "skiffd")
	ctx := context.Background()
	const name = "tbench"
	lab.Down(ctx, name)
	l, err := lab.Up(ctx, lab.Config{Name: name, Hosts: 2, ContainersPerHost: 2, BinDir: bin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lab.Down(context.Background(), name) })
	var progress bytes.Buffer
	report, err := bench.Run(ctx, l, bench.Options{Modes: []string{"host", "overlay"}, Quick: true,
		Workloads: []string{"tcp_stream", "tcp_rr", "udp_rr", "tcp_crr", "connect"},
		PerfBin:   filepath.Join(bin, "skiff-perf"), Progress: &progress})
	if err != nil {
		t.Fatalf("%v\nprogress:\n%s", err, progress.String())
	}
	var js bytes.Buffer
	if err := report.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	if err := bench.ValidateJSON(js.Bytes()); err != nil {
		t.Fatalf("quick bench JSON does not match the schema: %v\n%s", err, js.String())
	}
	seen := map[string]bool{}
	for _, r := range report.Results {
		if r.Mode == "overlay" && r.RatioToHost == nil {
			t.Errorf("%s %s has no ratio to host", r.Workload, r.Metric)
		}
		seen[r.Workload+"/"+r.Mode] = true
	}
	for _, w := range []string{"tcp_stream", "tcp_rr", "udp_rr", "tcp_crr", "connect"} {
		for _, m := range []string{"host", "overlay"} {
			if !seen[w+"/"+m] {
				t.Errorf("no result for %s in mode %s", w, m)
			}
		}
	}
}
