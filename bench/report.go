package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"time"
)

// SchemaVersion identifies the JSON document format described in SCHEMA.md.
const SchemaVersion = "skiff-bench/v1"

// Profile names.
const (
	ProfileQuick = "quick"
	ProfileFull  = "full"
)

// Report is the outcome of one benchmark run; its JSON form is SCHEMA.md.
type Report struct {
	Schema   string    `json:"schema"`
	Machine  Machine   `json:"machine"`
	Config   Config    `json:"config"`
	Results  []Result  `json:"results"`
	Failures []Failure `json:"failures"`
}

// Machine describes where the run happened.
type Machine struct {
	Kernel   string `json:"kernel"`
	CPUs     int    `json:"cpus"`
	CPUModel string `json:"cpu_model"`
	Date     string `json:"date"` // RFC 3339, start of the run
	Hostname string `json:"hostname"`
}

// Config is what was run.
type Config struct {
	Modes        []string `json:"modes"`
	Workloads    []string `json:"workloads"`
	Repeat       int      `json:"repeat"`
	SameHost     bool     `json:"same_host"`
	Profile      string   `json:"profile"`
	CellSeconds  float64  `json:"cell_seconds"`
	ConnectCount int      `json:"connect_count"`
	LabMode      string   `json:"lab_mode"`
	// Commit is the skiff commit measured (the binary's VCS stamp, with
	// "-dirty" for uncommitted changes; "unknown" without one).
	Commit string `json:"commit"`
}

// Result is one (workload, mode, metric) row. Pointer fields are null when
// there is no value (all samples failed, no host baseline, ...).
type Result struct {
	Workload    string    `json:"workload"`
	Mode        string    `json:"mode"`
	Metric      string    `json:"metric"`
	Unit        string    `json:"unit"`
	Better      string    `json:"better"`
	Median      *float64  `json:"median"`
	Min         *float64  `json:"min"`
	Max         *float64  `json:"max"`
	Samples     []float64 `json:"samples"`
	RatioToHost *float64  `json:"ratio_to_host"`
	// The median of the per-repetition ratios to host, and its 95 %
	// bootstrap interval (pairedRatio); null for host and below minPairs.
	Paired     *Paired  `json:"paired"`
	CPUPerUnit *float64 `json:"cpu_per_unit"`
	CPUUnit    string   `json:"cpu_unit"`
}

// Failure is one sample that was not used.
type Failure struct {
	Workload string `json:"workload"`
	Mode     string `json:"mode"`
	Rep      int    `json:"rep"`
	Error    string `json:"error"`
}

// WriteJSON writes the report as indented JSON (SCHEMA.md).
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(r); err != nil {
		return fmt.Errorf("write JSON report: %w", err)
	}
	return nil
}

// primaryResults returns, per workload in report order, the rows of its
// primary (first) metric.
func (r *Report) primaryResults() [][]Result {
	var groups [][]Result
	for _, name := range r.Config.Workloads {
		var rows []Result
		for _, res := range r.Results {
			if res.Workload != name {
				continue
			}
			if len(rows) > 0 && res.Metric != rows[0].Metric {
				break
			}
			rows = append(rows, res)
		}
		if len(rows) > 0 {
			groups = append(groups, rows)
		}
	}
	return groups
}

// find returns the row of (workload, mode, metric).
func (r *Report) find(workload, mode, metric string) (Result, bool) {
	for _, res := range r.Results {
		if res.Workload == workload && res.Mode == mode && res.Metric == metric {
			return res, true
		}
	}
	return Result{}, false
}

// collectMachine describes the machine the benchmark runs on.
func collectMachine(start time.Time) Machine {
	m := Machine{CPUs: runtime.NumCPU(), Date: start.Format(time.RFC3339), Kernel: "unknown", CPUModel: "unknown"}
	if data, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(data))
	}
	if name, err := os.Hostname(); err == nil {
		m.Hostname = name
	}
	if model := cpuModel(); model != "" {
		m.CPUModel = model
	}
	return m
}

func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		key, value, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(key) == "model name" {
			return strings.TrimSpace(value)
		}
	}
	return ""
}
