package bench

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"
)

// testReport builds a report through the runner's aggregation: tcp_rr has
// three host samples and two overlay samples (one failed); udp_stream
// overlay failed entirely, and host loss is 0 (no ratio possible).
func testReport(t *testing.T) (*Report, error) {
	t.Helper()
	ws, err := resolveWorkloads([]string{"tcp_rr", "udp_stream"}, false)
	if err != nil {
		t.Fatal(err)
	}
	r := &runner{
		lab: &fakeLab{mode: "overlay"}, prof: fullProfile, duration: 10 * time.Second, repeat: 3, connects: 10000,
		modes: []Mode{Modes["host"], Modes["overlay"]}, workloads: ws, outcomes: map[cellKey]*cellOutcome{},
	}
	rr := func(rate, p50, p99 float64) sample {
		return sample{Values: map[string]float64{"rate": rate, "p50": p50, "p99": p99, "p999": 2 * p99}}
	}
	rrCell := cell{Workload: ws[1], Mode: Modes["host"]}
	r.record(rrCell, rr(100, 20, 40), 10)
	r.record(rrCell, rr(120, 18, 38), 12)
	r.record(rrCell, rr(110, 19, 39), 11)
	rrCell.Mode = Modes["overlay"]
	r.record(rrCell, rr(80, 25, 50), 15)
	r.record(rrCell, rr(90, 24, 48), 14)
	rrCell.Rep = 2
	r.fail(rrCell, errors.New("skiff-perf tcp_rr: 3 errors in 1000 transactions"))
	udpCell := cell{Workload: ws[0], Mode: Modes["host"]}
	for i := range 3 {
		r.record(udpCell, sample{Values: map[string]float64{"throughput": 3 + float64(i), "loss": 0}}, 0.5)
	}
	udpCell.Mode = Modes["overlay"]
	for rep := 1; rep <= 3; rep++ {
		udpCell.Rep = rep
		r.fail(udpCell, errors.New("iperf3: unable to connect to server: Connection refused"))
	}
	rep := r.report(time.Date(2026, 11, 22, 5, 0, 0, 0, time.UTC))
	return rep, rep.incomplete()
}

func TestReportAggregation(t *testing.T) {
	rep, err := testReport(t)
	if !errors.Is(err, ErrIncomplete) || !strings.Contains(err.Error(), "udp_stream/overlay") {
		t.Fatalf("incomplete err = %v", err)
	}
	get := func(w, m, metric string) Result {
		res, ok := rep.find(w, m, metric)
		if !ok {
			t.Fatalf("no row %s/%s/%s", w, m, metric)
		}
		return res
	}
	host := get("tcp_rr", "host", "rate")
	if *host.Median != 110 || *host.Min != 100 || *host.Max != 120 || *host.RatioToHost != 1 || *host.CPUPerUnit != 11 {
		t.Errorf("host rate = %+v", host)
	}
	ov := get("tcp_rr", "overlay", "rate")
	if *ov.Median != 85 || !near(*ov.RatioToHost, 85.0/110) || *ov.CPUPerUnit != 14.5 || ov.Better != HigherIsBetter || ov.CPUUnit != cpuPerTxn {
		t.Errorf("overlay rate = %+v", ov)
	}
	if p99 := get("tcp_rr", "overlay", "p99"); !near(*p99.RatioToHost, 49.0/39) || p99.Better != LowerIsBetter || p99.Unit != unitMicros {
		t.Errorf("overlay p99 = %+v", p99)
	}
	if _, ok := rep.find("tcp_rr", "host", "p999"); ok {
		t.Error("tcp_rr reports p999, which is not one of its metrics")
	}
	failed := get("udp_stream", "overlay", "throughput")
	if failed.Median != nil || failed.RatioToHost != nil || failed.CPUPerUnit != nil || failed.Samples == nil || len(failed.Samples) != 0 {
		t.Errorf("failed cell = %+v", failed)
	}
	if loss := get("udp_stream", "host", "loss"); loss.RatioToHost != nil || *loss.Median != 0 {
		t.Errorf("zero host loss must give no ratio: %+v", loss)
	}
	if len(rep.Failures) != 4 || rep.Failures[0].Rep != 2 {
		t.Errorf("failures = %+v", rep.Failures)
	}
}

func TestJSONRoundTripAndValidate(t *testing.T) {
	rep, _ := testReport(t)
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	if err := ValidateJSON(buf.Bytes()); err != nil {
		t.Fatalf("own output rejected: %v\n%s", err, buf.String())
	}
	var back Report
	if err := json.Unmarshal(buf.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(&back, rep) {
		t.Fatalf("round trip differs:\n got %+v\nwant %+v", back, *rep)
	}
	if !strings.Contains(buf.String(), `"ratio_to_host": null`) || !strings.Contains(buf.String(), `"schema": "skiff-bench/v1"`) {
		t.Error("nulls or schema missing from JSON")
	}
}

func TestValidateJSONRejects(t *testing.T) {
	rep, _ := testReport(t)
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	good := buf.Bytes()
	// Each case breaks a fresh decoded copy of the valid document.
	tests := []struct {
		name    string
		breakIt func(doc map[string]any)
		wantErr string
	}{
		{"no schema", func(d map[string]any) { delete(d, "schema") }, "schema: missing"},
		{"wrong schema", func(d map[string]any) { d["schema"] = "skiff-bench/v0" }, "want \"skiff-bench/v1\""},
		{"cpus string", func(d map[string]any) { obj(d, "machine")["cpus"] = "2" }, "machine.cpus: not a number"},
		{"bad date", func(d map[string]any) { obj(d, "machine")["date"] = "yesterday" }, "RFC 3339"},
		{"no modes", func(d map[string]any) { obj(d, "config")["modes"] = []any{} }, "config.modes: empty"},
		{"bad profile", func(d map[string]any) { obj(d, "config")["profile"] = "medium" }, "config.profile"},
		{"repeat float", func(d map[string]any) { obj(d, "config")["repeat"] = 2.5 }, "not an integer"},
		{"results missing", func(d map[string]any) { delete(d, "results") }, "results: missing"},
		{"unknown unit", func(d map[string]any) { row(d, 0)["unit"] = "furlongs" }, "results[0].unit"},
		{"unknown cpu unit", func(d map[string]any) { row(d, 0)["cpu_unit"] = "watts" }, "results[0].cpu_unit"},
		{"bad better", func(d map[string]any) { row(d, 0)["better"] = "up" }, "results[0].better"},
		{"unknown mode", func(d map[string]any) { row(d, 0)["mode"] = "warp" }, "results[0].mode"},
		{"unknown workload", func(d map[string]any) { row(d, 0)["workload"] = "ping" }, "results[0].workload"},
		{"ratio dropped", func(d map[string]any) { findRow(d, "tcp_rr", "overlay")["ratio_to_host"] = nil }, "ratio_to_host is null but host has a median"},
		{"ratio key missing", func(d map[string]any) { delete(row(d, 0), "ratio_to_host") }, "ratio_to_host: missing"},
		{"min above median", func(d map[string]any) { row(d, 0)["min"] = 1e12 }, "min ≤ median ≤ max"},
		{"samples without median", func(d map[string]any) {
			r := findRow(d, "udp_stream", "overlay")
			r["samples"] = []any{1.0}
		}, "median is null"},
		{"median without samples", func(d map[string]any) { row(d, 0)["samples"] = []any{} }, "samples missing"},
		{"too many samples", func(d map[string]any) { row(d, 0)["samples"] = []any{1.0, 2.0, 3.0, 4.0} }, "4 samples but repeat is 3"},
		{"sample string", func(d map[string]any) { row(d, 0)["samples"] = []any{"1"} }, "samples[0]: not a number"},
		{"duplicate row", func(d map[string]any) {
			rs := d["results"].([]any)
			d["results"] = append(rs, rs[0])
		}, "duplicate row"},
		{"paired not an object", func(d map[string]any) { findRow(d, "tcp_rr", "overlay")["paired"] = 0.8 }, "paired: not an object"},
		{"paired without high", func(d map[string]any) {
			findRow(d, "tcp_rr", "overlay")["paired"] = map[string]any{"ratio": 0.8, "low": 0.75}
		}, "paired.high: missing"},
		{"paired outside its interval", func(d map[string]any) {
			findRow(d, "tcp_rr", "overlay")["paired"] = map[string]any{"ratio": 0.7, "low": 0.75, "high": 0.8}
		}, "does not hold"},
		{"paired on host", func(d map[string]any) {
			findRow(d, "tcp_rr", "host")["paired"] = map[string]any{"ratio": 1.0, "low": 1.0, "high": 1.0}
		}, "host row"},
		{"paired not a number", func(d map[string]any) {
			findRow(d, "tcp_rr", "overlay")["paired"] = map[string]any{"ratio": 0.8, "low": "low", "high": 0.9}
		}, "paired.low: not a number"},
		{"failure rep 0", func(d map[string]any) { d["failures"].([]any)[0].(map[string]any)["rep"] = 0.0 }, "failures[0].rep"},
		{"failure no error", func(d map[string]any) { d["failures"].([]any)[0].(map[string]any)["error"] = "" }, "failures[0].error: empty"},
		{"failures not array", func(d map[string]any) { d["failures"] = nil }, "failures: not an array"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var doc map[string]any
			if err := json.Unmarshal(good, &doc); err != nil {
				t.Fatal(err)
			}
			tt.breakIt(doc)
			data, err := json.Marshal(doc)
			if err != nil {
				t.Fatal(err)
			}
			err = ValidateJSON(data)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want it to contain %q", err, tt.wantErr)
			}
		})
	}
	if err := ValidateJSON([]byte("{not json")); err == nil {
		t.Error("invalid JSON accepted")
	}
}

func obj(d map[string]any, key string) map[string]any { return d[key].(map[string]any) }

func row(d map[string]any, i int) map[string]any { return d["results"].([]any)[i].(map[string]any) }

func findRow(d map[string]any, workload, mode string) map[string]any {
	for _, r := range d["results"].([]any) {
		m := r.(map[string]any)
		if m["workload"] == workload && m["mode"] == mode {
			return m
		}
	}
	panic("no row " + workload + "/" + mode)
}

func TestWriteTableAndMarkdown(t *testing.T) {
	rep, _ := testReport(t)
	var table, md bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"WORKLOAD", "OVERLAY/HOST", "tcp_rr", "rate (txn/s)", "110 (100–120)", "85.0 (80.0–90.0) [2/3]", "0.77×",
		"cpu (cpu_us/txn)", "14.5", "1.32×", "throughput (Gbit/s)", "FAILED", "whole-machine CPU", "share one kernel",
		"udp_stream/overlay rep 3: iperf3: unable to connect",
	} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	for _, want := range []string{"## skiff bench", "Machine: ", "| workload | metric | host | overlay | overlay/host |",
		"| --- | --- | ---: | ---: | ---: |", "| tcp_rr | rate (txn/s) | 110 (100–120) |", "- udp_stream/overlay rep 1:"} {
		if !strings.Contains(md.String(), want) {
			t.Errorf("markdown lacks %q:\n%s", want, md.String())
		}
	}
}

// TestReportPaired: with minPairs repetitions or more, a mode's row carries
// the median of its ratios to host's cell of the same repetition and the
// interval, and the table shows them in the ratio column.
func TestReportPaired(t *testing.T) {
	ws, err := resolveWorkloads([]string{"tcp_rr"}, false)
	if err != nil {
		t.Fatal(err)
	}
	r := &runner{
		lab: &fakeLab{mode: "overlay"}, prof: fullProfile, duration: time.Second, repeat: 6, connects: 10000,
		modes: []Mode{Modes["host"], Modes["overlay"]}, workloads: ws, outcomes: map[cellKey]*cellOutcome{},
	}
	rr := func(rate float64) sample {
		return sample{Values: map[string]float64{"rate": rate, "p50": 1e6 / rate, "p99": 2e6 / rate}}
	}
	for rep := 1; rep <= 6; rep++ {
		r.record(cell{Workload: ws[0], Mode: Modes["host"], Rep: rep}, rr(1000*float64(rep)), 10)
		c := cell{Workload: ws[0], Mode: Modes["overlay"], Rep: rep}
		if rep == 2 {
			r.fail(c, errors.New("lost"))
			continue
		}
		r.record(c, rr(800*float64(rep)), 10)
	}
	rep := r.report(time.Date(2026, 11, 22, 5, 0, 0, 0, time.UTC))
	ov, _ := rep.find("tcp_rr", "overlay", "rate")
	if p := ov.Paired; p == nil || !near(p.Ratio, 0.8) || !near(p.Low, 0.8) || !near(p.High, 0.8) {
		t.Fatalf("overlay rate paired = %+v, want 0.8 (0.8–0.8)", p)
	}
	if lat, _ := rep.find("tcp_rr", "overlay", "p50"); lat.Paired == nil || !near(lat.Paired.Ratio, 1.25) {
		t.Errorf("overlay p50 paired = %+v, want 1.25", lat.Paired)
	}
	if host, _ := rep.find("tcp_rr", "host", "rate"); host.Paired != nil {
		t.Errorf("host has a paired ratio: %+v", *host.Paired)
	}
	var js, table bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	if err := ValidateJSON(js.Bytes()); err != nil {
		t.Fatalf("own output rejected: %v", err)
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || !reflect.DeepEqual(&back, rep) {
		t.Fatalf("round trip differs (%v):\n%s", err, js.String())
	}
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "0.80× (0.80–0.80)") || !strings.Contains(table.String(), "bootstrap interval") {
		t.Errorf("table lacks the paired ratio or its footnote:\n%s", table.String())
	}
	// The chart draws the paired ratio too, with its interval.
	var svg bytes.Buffer
	if err := rep.WriteSVG(&svg); err != nil {
		t.Fatal(err)
	}
	if n := xmlElements(t, svg.Bytes())["path"]; n != 1 || !strings.Contains(svg.String(), "paired median over repetitions 0.80× (95 % interval 0.80–0.80)") {
		t.Errorf("chart has %d interval whiskers, or lacks the paired ratio:\n%s", n, svg.String())
	}
}

func TestWriteSVGWellFormed(t *testing.T) {
	rep, _ := testReport(t)
	rep.Results[0].Workload = "a<b&c" // escaping must hold
	rep.Config.Workloads[0] = "a<b&c"
	var buf bytes.Buffer
	if err := rep.WriteSVG(&buf); err != nil {
		t.Fatal(err)
	}
	counts := xmlElements(t, buf.Bytes())
	if counts["svg"] != 1 || counts["rect"] < 4 || counts["line"] < 3 || counts["title"] < 3 {
		t.Errorf("elements = %v", counts)
	}
	for _, want := range []string{"host = 1.0", "tcp_rr", "rate ↑ better", "0.77", "n/a", "a&lt;b&amp;c"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("SVG lacks %q", want)
		}
	}
	empty := &Report{Config: Config{Modes: []string{"overlay"}}}
	buf.Reset()
	if err := empty.WriteSVG(&buf); err != nil {
		t.Fatal(err)
	}
	xmlElements(t, buf.Bytes())
}

// xmlElements decodes an XML document fully and counts its elements.
func xmlElements(t *testing.T, data []byte) map[string]int {
	t.Helper()
	counts := map[string]int{}
	dec := xml.NewDecoder(bytes.NewReader(data))
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			return counts
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v\n%s", err, data)
		}
		if se, ok := tok.(xml.StartElement); ok {
			counts[se.Name.Local]++
		}
	}
}

func TestAxisScale(t *testing.T) {
	tests := []struct{ max, top, step float64 }{
		{1, 1.2, 0.25}, // 1.2 needs 5 ticks of 0.25 → top 1.25
		{0.5, 1.2, 0.25},
		{3, 3.5, 0.5},
		{40, 50, 10},
	}
	for _, tt := range tests {
		top, step := axisScale(tt.max)
		if step != tt.step || top < tt.top || top > tt.top+step {
			t.Errorf("axisScale(%v) = %v, %v", tt.max, top, step)
		}
	}
}
