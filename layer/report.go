package layer

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/skiffnet/skiff/api"
)

// Report is what a running layer says about itself: skiff status shows its
// View and counters, skiff status --json its Details, and the agent's
// /metrics serves its Metrics. Nothing outside the layer's package knows
// their shape.
type Report struct {
	// Counters are the layer's event counters by name (their names from
	// the programs' enum: bpfmap.CounterNames).
	Counters map[string]uint64
	// Details is the layer's own status, a type of its package, shown as
	// JSON (api.Layer.Details; the package decodes it for its tests).
	Details any
	// View is how skiff status shows the layer.
	View []api.Section
	// Metrics are the layer's Prometheus metrics (Metrics helps).
	Metrics []prometheus.Metric
}

// Inspector is a layer with a view longer than its status (its maps'
// entries): skiff layer NAME (GET /v1/layers/NAME) shows it.
type Inspector interface {
	Inspect() (Report, error)
}

// Metrics builds a layer's Prometheus metrics, all named skiff_<layer>_...
// (skiff_... without a layer: the agent's own).
type Metrics struct {
	Layer string
	out   []prometheus.Metric
}

func (m *Metrics) name(n string) string {
	if m.Layer == "" {
		return "skiff_" + n
	}
	return "skiff_" + m.Layer + "_" + n
}

// Add adds one metric family: value(i) and labels(i) for each of n
// metrics (labels nil: none).
func (m *Metrics) Add(name, help string, typ prometheus.ValueType, labelNames []string, n int, value func(i int) float64, labels func(i int) []string) {
	desc := prometheus.NewDesc(m.name(name), help, labelNames, nil)
	for i := range n {
		var lv []string
		if labels != nil {
			lv = labels(i)
		}
		m.out = append(m.out, prometheus.MustNewConstMetric(desc, typ, value(i), lv...))
	}
}

// Gauge adds one metric without labels.
func (m *Metrics) Gauge(name, help string, v float64) {
	m.Add(name, help, prometheus.GaugeValue, nil, 1, func(int) float64 { return v }, nil)
}

// Counters adds a counter family with one label for the counters by name,
// in name order.
func (m *Metrics) Counters(name, help, label string, counters map[string]uint64) {
	names := make([]string, 0, len(counters))
	for k := range counters {
		names = append(names, k)
	}
	slices.Sort(names)
	m.Add(name, help, prometheus.CounterValue, []string{label}, len(names),
		func(i int) float64 { return float64(counters[names[i]]) }, func(i int) []string { return names[i : i+1] })
}

// List returns the metrics added.
func (m *Metrics) List() []prometheus.Metric { return m.out }

// CounterRows are table rows of the non-zero counters, in the order of
// names (a layer's enum order).
func CounterRows(names []string, counters map[string]uint64) [][]string {
	var rows [][]string
	for _, n := range names {
		if v := counters[n]; v > 0 {
			rows = append(rows, []string{n, strconv.FormatUint(v, 10)})
		}
	}
	return rows
}

// DetailsOf decodes the details a running layer reported in a host's
// status into its package's type: nil when the layer does not run there.
func DetailsOf[T any](st api.Status, name string) (*T, api.Layer, error) {
	i := slices.IndexFunc(st.Layers, func(l api.Layer) bool { return l.Name == name && l.On })
	if i < 0 {
		return nil, api.Layer{}, nil
	}
	var v T
	if len(st.Layers[i].Details) > 0 {
		if err := json.Unmarshal(st.Layers[i].Details, &v); err != nil {
			return nil, st.Layers[i], fmt.Errorf("%s status: %w", name, err)
		}
	}
	return &v, st.Layers[i], nil
}
