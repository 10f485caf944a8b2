package bench

import (
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
)

// The regression gate (make bench-check): auto, skiff's default, is never
// slower than its own parts, and what a user who does nothing gets
// (auto-plain) loses nothing against the cache alone. Floors are on
// ratios to host from one paired run, cross-host (the issue that set them:
// "auto is never slower than its own parts").
var (
	// autoFloors: auto/host on these workloads.
	autoFloors = map[string]float64{"tcp_stream": 0.95, "tcp_stream_4": 0.95, "nginx": 0.93, "memcached": 0.95, "tcp_rr": 0.95}
	// singleLayers are the modes auto is made of, measured alone.
	singleLayers = []string{"overlay", "cache", "sockets", "channels", "steering"}
)

const (
	partsFloor     = 0.95 // auto and auto-plain against their parts
	autoCPUCeiling = 1.10 // auto's tcp_stream CPU per Gbit / host's
)

// Verdict is one floor of the gate and what the run gave.
type Verdict struct {
	Floor string  // what must hold
	Got   float64 // measured (a ratio)
	Want  float64 // the bound
	Pass  bool
	Note  string // the interval or the comparison's parts
}

// Check judges the report against the gate's floors. A floor whose modes
// or workload the run did not measure is left out; a mode that has no
// value for a workload fails it.
func (r *Report) Check() []Verdict {
	var out []Verdict
	has := func(mode string) bool { return slices.Contains(r.Config.Modes, mode) }
	for _, rows := range r.primaryResults() {
		w := rows[0].Workload
		if min, ok := autoFloors[w]; ok && has("auto") {
			g, note := r.goodness(w, "auto")
			out = append(out, Verdict{Floor: fmt.Sprintf("auto/host %s ≥ %.2f", w, min), Got: g, Want: min, Pass: g >= min, Note: note})
		}
		if w == "tcp_stream" && has("auto-plain") {
			g, note := r.goodness(w, "auto-plain")
			out = append(out, Verdict{Floor: "auto-plain/host tcp_stream ≥ 0.95", Got: g, Want: partsFloor, Pass: g >= partsFloor, Note: note})
		}
		if has("auto") {
			best, bestMode := 0.0, ""
			for _, m := range singleLayers {
				if !has(m) {
					continue
				}
				if g, _ := r.goodness(w, m); g > best {
					best, bestMode = g, m
				}
			}
			if bestMode != "" {
				g, _ := r.goodness(w, "auto")
				q := g / best
				out = append(out, Verdict{Floor: fmt.Sprintf("auto ≥ %.2f × best part, %s", partsFloor, w), Got: q, Want: partsFloor, Pass: q >= partsFloor,
					Note: fmt.Sprintf("auto %.2f, %s %.2f", g, bestMode, best)})
			}
		}
		if has("auto-plain") && has("cache") {
			g, _ := r.goodness(w, "auto-plain")
			c, _ := r.goodness(w, "cache")
			q := 0.0
			if c > 0 {
				q = g / c
			}
			out = append(out, Verdict{Floor: fmt.Sprintf("auto-plain ≥ %.2f × cache, %s", partsFloor, w), Got: q, Want: partsFloor, Pass: q >= partsFloor,
				Note: fmt.Sprintf("auto-plain %.2f, cache %.2f", g, c)})
		}
	}
	if has("auto") {
		if rows := r.rowsOf("tcp_stream"); rows != nil {
			host, _ := r.find("tcp_stream", HostMode, rows[0].Metric)
			auto, _ := r.find("tcp_stream", "auto", rows[0].Metric)
			v := Verdict{Floor: fmt.Sprintf("auto tcp_stream CPU per Gbit ≤ %.2f × host's", autoCPUCeiling), Want: autoCPUCeiling}
			if host.CPUPerUnit != nil && auto.CPUPerUnit != nil && *host.CPUPerUnit > 0 {
				v.Got = *auto.CPUPerUnit / *host.CPUPerUnit
				v.Pass = v.Got <= autoCPUCeiling
				v.Note = fmt.Sprintf("%.3f vs %.3f %s", *auto.CPUPerUnit, *host.CPUPerUnit, auto.CPUUnit)
			} else {
				v.Note = "no CPU figures"
			}
			out = append(out, v)
		}
	}
	return out
}

// rowsOf returns the primary metric's rows of a workload, or nil.
func (r *Report) rowsOf(workload string) []Result {
	for _, rows := range r.primaryResults() {
		if rows[0].Workload == workload {
			return rows
		}
	}
	return nil
}

// goodness is a mode's paired ratio to host on a workload's primary metric
// (the ratio of medians without pairs), turned so that higher is better
// (a latency's ratio inverted), with its interval as a note; 0 without a
// value.
func (r *Report) goodness(workload, mode string) (float64, string) {
	rows := r.rowsOf(workload)
	if rows == nil {
		return 0, "not measured"
	}
	res, ok := r.find(workload, mode, rows[0].Metric)
	if !ok {
		return 0, "not measured"
	}
	q, lo, hi := 0.0, 0.0, 0.0
	switch {
	case res.Paired != nil:
		q, lo, hi = res.Paired.Ratio, res.Paired.Low, res.Paired.High
	case res.RatioToHost != nil:
		q, lo, hi = *res.RatioToHost, *res.RatioToHost, *res.RatioToHost
	default:
		return 0, "no value"
	}
	if res.Better == LowerIsBetter {
		if q == 0 || lo == 0 || hi == 0 {
			return 0, "no value"
		}
		q, lo, hi = 1/q, 1/hi, 1/lo
	}
	return q, fmt.Sprintf("%.2f–%.2f", lo, hi)
}

// WriteCheck prints the verdicts, one floor a line, and the count of
// failures.
func WriteCheck(w io.Writer, verdicts []Verdict) (failed int, err error) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FLOOR\tGOT\tRESULT\tNOTE")
	for _, v := range verdicts {
		res := "PASS"
		if !v.Pass {
			res = "FAIL"
			failed++
		}
		fmt.Fprintf(tw, "%s\t%.2f\t%s\t%s\n", v.Floor, v.Got, res, v.Note)
	}
	fmt.Fprintf(tw, "%d of %d floors failed\n", failed, len(verdicts))
	return failed, tw.Flush()
}
