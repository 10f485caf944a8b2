package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/overlay"
)

// ServeMetrics exposes the agent's and its layers' metrics in the
// Prometheus text format on addr until ctx ends. Counters are read from the
// (pinned) maps at scrape time: each layer reports its own (layer.Report).
func (a *Agent) ServeMetrics(ctx context.Context, addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics listener: %w", err)
	}
	reg := prometheus.NewRegistry()
	if err := reg.Register(collector{a}); err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slogPrinter{a}}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("metrics server stopped", "err", err)
		}
	}()
	a.log.Info("metrics listening", "addr", l.Addr())
	return nil
}

// collector reads the agent's status at each scrape. Unchecked (it
// describes nothing): which metrics there are depends on the layers that
// run.
type collector struct{ a *Agent }

func (collector) Describe(chan<- *prometheus.Desc) {}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, reports := c.a.status(ctx)
	for _, m := range agentMetrics(st) {
		ch <- m
	}
	for _, r := range reports {
		for _, m := range r.Metrics {
			ch <- m
		}
	}
}

// agentMetrics are the agent's own metrics and the overlay's.
func agentMetrics(st api.Status) []prometheus.Metric {
	m := layer.Metrics{}
	boolean := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	m.Gauge("endpoints", "Container endpoints on this host.", float64(st.Endpoints))
	m.Gauge("remote_hosts", "Other hosts in the cluster.", float64(st.RemoteHosts))
	m.Gauge("store_reachable", "Whether the cluster store answers.", boolean(st.StoreReachable))
	m.Gauge("ready", "Whether the agent is registered and in sync.", boolean(st.Ready))
	m.Add("layer_on", "Whether a data-plane layer runs on this host (skiff status says why one is off).", prometheus.GaugeValue,
		[]string{"layer"}, len(st.Layers), func(i int) float64 { return boolean(st.Layers[i].On) }, func(i int) []string { return []string{st.Layers[i].Name} })
	if st.SourceDrops != nil {
		reasons := overlay.SourceReasons()
		m.Add("source_check_drops_total", "Packets of containers the source check on their veths dropped, by reason (docs/security.md).",
			prometheus.CounterValue, []string{"reason"}, len(reasons), func(i int) float64 { return float64(st.SourceDrops[reasons[i]]) },
			func(i int) []string { return reasons[i : i+1] })
	}
	if len(st.PolicyDenies) > 0 {
		m.Counters("policy_denied_packets_total", "Packets the policy denied on this host, by rule (new flows and broadcast copies; zeroed when the rules change).", "rule", st.PolicyDenies)
	}
	if len(st.QoS) > 0 {
		m.Counters("qos_packets_total", "Underlay packets of QoS-classed containers marked, and of normal ones (docs/limits.md).", "outcome", st.QoS)
	}
	if len(st.Maps) > 0 {
		m.Add("map_entries", "Entries in the host's eBPF maps whose entries come and go, by map (docs/maps.md: their sizes and what a full one does).", prometheus.GaugeValue,
			[]string{"map"}, len(st.Maps), func(i int) float64 { return float64(st.Maps[i].Entries) }, func(i int) []string { return []string{st.Maps[i].Name} })
		m.Add("map_capacity", "Capacity of the host's eBPF maps whose entries come and go, by map.", prometheus.GaugeValue,
			[]string{"map"}, len(st.Maps), func(i int) float64 { return float64(st.Maps[i].Capacity) }, func(i int) []string { return []string{st.Maps[i].Name} })
	}
	return m.List()
}

// slogPrinter logs promhttp's errors.
type slogPrinter struct{ a *Agent }

func (p slogPrinter) Println(v ...any) { p.a.log.Warn("metrics", "err", fmt.Sprint(v...)) }
