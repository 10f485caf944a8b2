// Package layertest reads a layer's report in tests: its Prometheus
// metrics as a scrape would serve them.
package layertest

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
)

// collector serves fixed metrics.
type collector []prometheus.Metric

func (collector) Describe(chan<- *prometheus.Desc) {}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	for _, m := range c {
		ch <- m
	}
}

// Text is the metrics in the Prometheus text format, as /metrics serves
// them (the registry checks them: names, label sets, duplicates).
func Text(t testing.TB, ms []prometheus.Metric) string {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collector(ms))
	fams, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	var b strings.Builder
	for _, f := range fams {
		if _, err := expfmt.MetricFamilyToText(&b, f); err != nil {
			t.Fatal(err)
		}
	}
	return b.String()
}

// Value is the value of the metric name whose labels include want, in a
// text as Text writes it.
func Value(t testing.TB, text, name string, want map[string]string) float64 {
	t.Helper()
	var p expfmt.TextParser
	fams, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("not the Prometheus text format: %v\n%s", err, text)
	}
	f, ok := fams[name]
	if !ok {
		t.Fatalf("no %s in\n%s", name, text)
	}
metrics:
	for _, m := range f.Metric {
		labels := map[string]string{}
		for _, l := range m.Label {
			labels[l.GetName()] = l.GetValue()
		}
		for k, v := range want {
			if labels[k] != v {
				continue metrics
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		}
	}
	t.Fatalf("no %s%v in\n%s", name, want, text)
	return 0
}
