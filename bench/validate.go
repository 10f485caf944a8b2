package bench

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"time"
)

// Known units (SCHEMA.md).
var (
	knownUnits    = []string{unitGbps, unitPercent, unitTxnPerSec, unitPktPerSec, unitReqPerSec, unitOpsPerSec, unitMicros}
	knownCPUUnits = []string{cpuPerGbit, cpuPerTxn}
)

// ValidateJSON checks a skiff-bench/v1 document (SCHEMA.md): required keys
// and their types, known units and directions, consistent statistics, and a
// ratio_to_host for every mode's median when the host has a non-zero median.
func ValidateJSON(data []byte) error {
	var doc map[string]any
	if err := json.Unmarshal(data, &doc); err != nil {
		return fmt.Errorf("bench JSON: %w", err)
	}
	if err := validateDoc(doc); err != nil {
		return fmt.Errorf("bench JSON: %w", err)
	}
	return nil
}

func validateDoc(doc map[string]any) error {
	schema, err := getString(doc, "schema", "")
	if err != nil {
		return err
	}
	if schema != SchemaVersion {
		return fmt.Errorf("schema is %q, want %q", schema, SchemaVersion)
	}
	machine, err := getObject(doc, "machine", "")
	if err != nil {
		return err
	}
	if err := validateMachine(machine); err != nil {
		return err
	}
	config, err := getObject(doc, "config", "")
	if err != nil {
		return err
	}
	cfg, err := validateConfig(config)
	if err != nil {
		return err
	}
	results, err := getArray(doc, "results", "")
	if err != nil {
		return err
	}
	if err := validateResults(results, cfg); err != nil {
		return err
	}
	failures, err := getArray(doc, "failures", "")
	if err != nil {
		return err
	}
	return validateFailures(failures, cfg)
}

func validateMachine(m map[string]any) error {
	for _, key := range []string{"kernel", "cpu_model", "hostname"} {
		if _, err := getString(m, key, "machine"); err != nil {
			return err
		}
	}
	if cpus, err := getInt(m, "cpus", "machine"); err != nil {
		return err
	} else if cpus < 1 {
		return fmt.Errorf("machine.cpus is %d, want ≥ 1", cpus)
	}
	date, err := getString(m, "date", "machine")
	if err != nil {
		return err
	}
	if _, err := time.Parse(time.RFC3339, date); err != nil {
		return fmt.Errorf("machine.date: not RFC 3339: %w", err)
	}
	return nil
}

func validateConfig(c map[string]any) (Config, error) {
	var cfg Config
	var err error
	if cfg.Modes, err = getNonEmptyStrings(c, "modes", "config"); err != nil {
		return cfg, err
	}
	if cfg.Workloads, err = getNonEmptyStrings(c, "workloads", "config"); err != nil {
		return cfg, err
	}
	if cfg.Repeat, err = getInt(c, "repeat", "config"); err != nil {
		return cfg, err
	}
	if cfg.Repeat < 1 {
		return cfg, fmt.Errorf("config.repeat is %d, want ≥ 1", cfg.Repeat)
	}
	if cfg.SameHost, err = getBool(c, "same_host", "config"); err != nil {
		return cfg, err
	}
	if cfg.Profile, err = getString(c, "profile", "config"); err != nil {
		return cfg, err
	}
	if cfg.Profile != ProfileQuick && cfg.Profile != ProfileFull {
		return cfg, fmt.Errorf("config.profile is %q, want %q or %q", cfg.Profile, ProfileQuick, ProfileFull)
	}
	if cfg.CellSeconds, err = getNumber(c, "cell_seconds", "config"); err != nil {
		return cfg, err
	}
	if cfg.CellSeconds <= 0 {
		return cfg, fmt.Errorf("config.cell_seconds is %g, want > 0", cfg.CellSeconds)
	}
	if _, ok := c["commit"]; ok { // optional: reports from before it have none
		if cfg.Commit, err = getString(c, "commit", "config"); err != nil {
			return cfg, err
		}
	}
	return cfg, nil
}

type resultKey struct{ workload, mode, metric string }

func validateResults(results []any, cfg Config) error {
	medians := map[resultKey]*float64{}
	rows := make([]Result, 0, len(results))
	for i, item := range results {
		path := fmt.Sprintf("results[%d]", i)
		row, ok := item.(map[string]any)
		if !ok {
			return fmt.Errorf("%s: not an object", path)
		}
		key, res, err := validateResult(row, path, cfg)
		if err != nil {
			return err
		}
		if _, dup := medians[key]; dup {
			return fmt.Errorf("%s: duplicate row for %s/%s/%s", path, key.workload, key.mode, key.metric)
		}
		medians[key] = res.Median
		rows = append(rows, res)
	}
	return checkRatios(rows, medians)
}

// checkRatios requires ratio_to_host on every row with a median when the
// host row of the same workload and metric has a non-zero median.
func checkRatios(rows []Result, medians map[resultKey]*float64) error {
	for i, r := range rows {
		if r.Median == nil || r.RatioToHost != nil {
			continue
		}
		if host := medians[resultKey{r.Workload, HostMode, r.Metric}]; host != nil && *host != 0 {
			return fmt.Errorf("results[%d]: ratio_to_host is null but host has a median", i)
		}
	}
	return nil
}

func validateResult(row map[string]any, path string, cfg Config) (resultKey, Result, error) {
	var r Result
	var err error
	fail := func(err error) (resultKey, Result, error) { return resultKey{}, r, err }
	if r.Workload, err = getOneOf(row, "workload", path, cfg.Workloads); err != nil {
		return fail(err)
	}
	if r.Mode, err = getOneOf(row, "mode", path, cfg.Modes); err != nil {
		return fail(err)
	}
	if r.Metric, err = getString(row, "metric", path); err != nil {
		return fail(err)
	}
	if r.Metric == "" {
		return fail(fmt.Errorf("%s.metric: empty", path))
	}
	if r.Unit, err = getOneOf(row, "unit", path, knownUnits); err != nil {
		return fail(err)
	}
	if r.Better, err = getOneOf(row, "better", path, []string{HigherIsBetter, LowerIsBetter}); err != nil {
		return fail(err)
	}
	if r.CPUUnit, err = getOneOf(row, "cpu_unit", path, knownCPUUnits); err != nil {
		return fail(err)
	}
	if err := validateStats(row, path, cfg.Repeat, &r); err != nil {
		return fail(err)
	}
	if r.RatioToHost, err = getNullableNumber(row, "ratio_to_host", path); err != nil {
		return fail(err)
	}
	if r.CPUPerUnit, err = getNullableNumber(row, "cpu_per_unit", path); err != nil {
		return fail(err)
	}
	if err := validatePaired(row, path, &r); err != nil {
		return fail(err)
	}
	return resultKey{r.Workload, r.Mode, r.Metric}, r, nil
}

// validatePaired checks paired: null (or absent, as in reports from before
// it) or an object of three numbers with low ≤ ratio ≤ high, and null on
// host's rows and rows without a median.
func validatePaired(row map[string]any, path string, r *Result) error {
	if v, ok := row["paired"]; !ok || v == nil {
		return nil
	}
	o, err := getObject(row, "paired", path)
	if err != nil {
		return err
	}
	path += ".paired"
	var p Paired
	for key, dst := range map[string]*float64{"ratio": &p.Ratio, "low": &p.Low, "high": &p.High} {
		if *dst, err = getNumber(o, key, path); err != nil {
			return err
		}
	}
	if r.Mode == HostMode || r.Median == nil {
		return fmt.Errorf("%s: set on a host row or a row without a median", path)
	}
	if p.Low > p.Ratio || p.Ratio > p.High {
		return fmt.Errorf("%s: low %g ≤ ratio %g ≤ high %g does not hold", path, p.Low, p.Ratio, p.High)
	}
	r.Paired = &p
	return nil
}

// validateStats checks median/min/max/samples agree with each other.
func validateStats(row map[string]any, path string, repeat int, r *Result) error {
	var err error
	if r.Median, err = getNullableNumber(row, "median", path); err != nil {
		return err
	}
	if r.Min, err = getNullableNumber(row, "min", path); err != nil {
		return err
	}
	if r.Max, err = getNullableNumber(row, "max", path); err != nil {
		return err
	}
	samples, err := getArray(row, "samples", path)
	if err != nil {
		return err
	}
	for j, s := range samples {
		if _, ok := s.(float64); !ok {
			return fmt.Errorf("%s.samples[%d]: not a number", path, j)
		}
	}
	if len(samples) > repeat {
		return fmt.Errorf("%s: %d samples but repeat is %d", path, len(samples), repeat)
	}
	if r.Median == nil {
		if r.Min != nil || r.Max != nil || len(samples) > 0 {
			return fmt.Errorf("%s: median is null but min, max or samples are set", path)
		}
		return nil
	}
	if r.Min == nil || r.Max == nil || len(samples) == 0 {
		return fmt.Errorf("%s: median set but min, max or samples missing", path)
	}
	if *r.Min > *r.Median || *r.Median > *r.Max {
		return fmt.Errorf("%s: want min ≤ median ≤ max, got %g, %g, %g", path, *r.Min, *r.Median, *r.Max)
	}
	return nil
}

func validateFailures(failures []any, cfg Config) error {
	for i, item := range failures {
		path := fmt.Sprintf("failures[%d]", i)
		f, ok := item.(map[string]any)
		if !ok {
			return fmt.Errorf("%s: not an object", path)
		}
		if _, err := getOneOf(f, "workload", path, cfg.Workloads); err != nil {
			return err
		}
		if _, err := getOneOf(f, "mode", path, cfg.Modes); err != nil {
			return err
		}
		rep, err := getInt(f, "rep", path)
		if err != nil {
			return err
		}
		if rep < 1 || rep > cfg.Repeat {
			return fmt.Errorf("%s.rep is %d, want 1..%d", path, rep, cfg.Repeat)
		}
		if msg, err := getString(f, "error", path); err != nil {
			return err
		} else if msg == "" {
			return fmt.Errorf("%s.error: empty", path)
		}
	}
	return nil
}

// --- typed access to decoded JSON -------------------------------------------

func field(m map[string]any, key, path string) (any, string, error) {
	name := key
	if path != "" {
		name = path + "." + key
	}
	v, ok := m[key]
	if !ok {
		return nil, name, fmt.Errorf("%s: missing", name)
	}
	return v, name, nil
}

func getString(m map[string]any, key, path string) (string, error) {
	v, name, err := field(m, key, path)
	if err != nil {
		return "", err
	}
	s, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("%s: not a string", name)
	}
	return s, nil
}

func getOneOf(m map[string]any, key, path string, allowed []string) (string, error) {
	s, err := getString(m, key, path)
	if err != nil {
		return "", err
	}
	if !slices.Contains(allowed, s) {
		return "", fmt.Errorf("%s.%s: %q is not one of %v", path, key, s, allowed)
	}
	return s, nil
}

func getNumber(m map[string]any, key, path string) (float64, error) {
	v, name, err := field(m, key, path)
	if err != nil {
		return 0, err
	}
	f, ok := v.(float64)
	if !ok {
		return 0, fmt.Errorf("%s: not a number", name)
	}
	return f, nil
}

func getNullableNumber(m map[string]any, key, path string) (*float64, error) {
	v, name, err := field(m, key, path)
	if err != nil || v == nil {
		return nil, err
	}
	f, ok := v.(float64)
	if !ok {
		return nil, fmt.Errorf("%s: not a number or null", name)
	}
	return &f, nil
}

func getInt(m map[string]any, key, path string) (int, error) {
	f, err := getNumber(m, key, path)
	if err != nil {
		return 0, err
	}
	if f != math.Trunc(f) {
		return 0, fmt.Errorf("%s.%s: %g is not an integer", path, key, f)
	}
	return int(f), nil
}

func getBool(m map[string]any, key, path string) (bool, error) {
	v, name, err := field(m, key, path)
	if err != nil {
		return false, err
	}
	b, ok := v.(bool)
	if !ok {
		return false, fmt.Errorf("%s: not a boolean", name)
	}
	return b, nil
}

func getObject(m map[string]any, key, path string) (map[string]any, error) {
	v, name, err := field(m, key, path)
	if err != nil {
		return nil, err
	}
	o, ok := v.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%s: not an object", name)
	}
	return o, nil
}

func getArray(m map[string]any, key, path string) ([]any, error) {
	v, name, err := field(m, key, path)
	if err != nil {
		return nil, err
	}
	a, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("%s: not an array", name)
	}
	return a, nil
}

func getNonEmptyStrings(m map[string]any, key, path string) ([]string, error) {
	a, err := getArray(m, key, path)
	if err != nil {
		return nil, err
	}
	if len(a) == 0 {
		return nil, fmt.Errorf("%s.%s: empty", path, key)
	}
	out := make([]string, len(a))
	for i, v := range a {
		s, ok := v.(string)
		if !ok || s == "" {
			return nil, fmt.Errorf("%s.%s[%d]: not a non-empty string", path, key, i)
		}
		out[i] = s
	}
	return out, nil
}
