package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/overlay"
)

// ServeMetrics exposes the agent's and the fast path's counters in the
// Prometheus text format on addr until ctx ends. Counters are read from the
// (pinned) maps at scrape time.
func (a *Agent) ServeMetrics(ctx context.Context, addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics listener: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		a.writeMetrics(r.Context(), w)
	})
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

func (a *Agent) writeMetrics(ctx context.Context, w http.ResponseWriter) {
	w.Write([]byte(renderMetrics(a.Status(ctx))))
}

// renderMetrics renders a status in the Prometheus text format.
func renderMetrics(st api.Status) string {
	b := &strings.Builder{}
	family := func(name, typ, help string) {
		fmt.Fprintf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
	}
	gauge := func(name, help string, v float64) {
		family(name, "gauge", help)
		fmt.Fprintf(b, "%s %g\n", name, v)
	}
	boolean := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	gauge("skiff_endpoints", "Container endpoints on this host.", float64(st.Endpoints))
	gauge("skiff_remote_hosts", "Other hosts in the cluster.", float64(st.RemoteHosts))
	gauge("skiff_store_reachable", "Whether the cluster store answers.", boolean(st.StoreReachable))
	gauge("skiff_ready", "Whether the agent is registered and in sync.", boolean(st.Ready))
	family("skiff_layer_on", "gauge", "Whether a data-plane layer runs on this host (skiff status says why one is off).")
	for _, l := range st.Layers {
		fmt.Fprintf(b, "skiff_layer_on{layer=%q} %g\n", l.Name, boolean(l.On))
	}
	if st.SourceDrops != nil {
		family("skiff_source_check_drops_total", "counter", "Packets of containers the source check on their veths dropped, by reason (docs/security.md).")
		for _, r := range overlay.SourceReasons() {
			fmt.Fprintf(b, "skiff_source_check_drops_total{reason=%q} %d\n", r, st.SourceDrops[r])
		}
	}
	if st.Cache != nil {
		family("skiff_cache_packets_total", "counter", "Packets handled by the cache programs, by program and outcome.")
		reasons := append([]cache.Reason(nil), cache.Reasons...)
		sort.Slice(reasons, func(i, j int) bool { return reasons[i].Name < reasons[j].Name })
		for _, r := range reasons {
			fmt.Fprintf(b, "skiff_cache_packets_total{program=%q,outcome=%q} %d\n", r.Program, r.Outcome, st.Cache[r.Name])
		}
	}
	if c := st.Channels; c != nil {
		family("skiff_channels_events_total", "counter", "Events of the channels layer's programs (docs/channels.md, Status).")
		for _, name := range slices.Sorted(maps.Keys(c.Counters)) {
			fmt.Fprintf(b, "skiff_channels_events_total{event=%q} %d\n", name, c.Counters[name])
		}
		gauge("skiff_channels_sockets", "Sockets in the channel map now (two a channelled connection).", float64(c.Sockets))
	}
	if s := st.Steering; s != nil {
		family("skiff_steering_stage_packets_total", "counter", "Packets of overlay flows each stage of the receive path processed, by CPU (docs/steering.md).")
		for _, stage := range s.Stages {
			for cpu, n := range stage.Packets {
				fmt.Fprintf(b, "skiff_steering_stage_packets_total{stage=%q,cpu=\"%d\"} %d\n", stage.Name, cpu, n)
			}
		}
		family("skiff_steering_decisions_total", "counter", "The steering programs' decisions and what they left alone, by reason.")
		for _, name := range slices.Sorted(maps.Keys(s.Decisions)) {
			fmt.Fprintf(b, "skiff_steering_decisions_total{decision=%q} %d\n", name, s.Decisions[name])
		}
		family("skiff_steering_cpu_load", "gauge", "Each steering CPU's load as last sampled (percent, smoothed).")
		for _, cpu := range slices.Sorted(maps.Keys(s.Load)) {
			fmt.Fprintf(b, "skiff_steering_cpu_load{cpu=\"%d\"} %d\n", cpu, s.Load[cpu])
		}
	}
	if len(st.QoS) > 0 {
		family("skiff_qos_packets_total", "counter", "Underlay packets of QoS-classed containers marked, and of normal ones (docs/limits.md).")
		for _, name := range slices.Sorted(maps.Keys(st.QoS)) {
			fmt.Fprintf(b, "skiff_qos_packets_total{outcome=%q} %d\n", name, st.QoS[name])
		}
	}
	if s := st.Sockets; s != nil {
		family("skiff_sockets_events_total", "counter", "Events of the sockets layer's programs (docs/sockets.md, Operating it).")
		for _, name := range slices.Sorted(maps.Keys(s.Counters)) {
			fmt.Fprintf(b, "skiff_sockets_events_total{event=%q} %d\n", name, s.Counters[name])
		}
		gauge("skiff_sockets_listeners", "Replaced listeners on this host.", float64(len(s.Listeners)))
		gauge("skiff_sockets_policy_in_force", "Whether connect judges new fast-path connections by a policy; 0: every connection takes the overlay.",
			boolean(s.Policy != nil && !s.Policy.Overflow))
		rules := 0
		if s.Policy != nil {
			rules = s.Policy.Rules
		}
		gauge("skiff_sockets_policy_rules", "TCP rules of the policy the sockets layer judges connections by.", float64(rules))
		perContainer := []struct {
			name, typ, help string
			value           func(api.SocketsContainer) uint64
		}{
			{"skiff_sockets_broker_up", "gauge", "Whether the container's socket broker runs.",
				func(c api.SocketsContainer) uint64 { return uint64(boolean(c.Broker)) }},
			{"skiff_sockets_handed_out_total", "counter", "Host sockets the broker gave the container's processes.",
				func(c api.SocketsContainer) uint64 { return c.HandedOut }},
			{"skiff_sockets_replaced_total", "counter", "Connections and listeners of the container on host sockets, as its shims report them.",
				func(c api.SocketsContainer) uint64 { return c.Replaced }},
			{"skiff_sockets_fallback_total", "counter", "Sockets of the container that fell back to the overlay, as its shims report them.",
				func(c api.SocketsContainer) uint64 { return c.Fallback }},
			{"skiff_sockets_seccomp_listeners", "gauge", "Seccomp listeners of the container's processes its broker serves (skiff's seccomp profile).",
				func(c api.SocketsContainer) uint64 { return c.Seccomp.Listeners }},
			{"skiff_sockets_seccomp_replaced_total", "counter", "connect and listen calls the broker's seccomp agent moved to host sockets.",
				func(c api.SocketsContainer) uint64 { return c.Seccomp.Replaced }},
			{"skiff_sockets_seccomp_fallback_total", "counter", "connect and listen calls in the cluster the seccomp agent left on the container's socket.",
				func(c api.SocketsContainer) uint64 { return c.Seccomp.Fallback }},
			{"skiff_sockets_seccomp_passed_total", "counter", "connect and listen calls the seccomp agent continued untouched (not for the fast path).",
				func(c api.SocketsContainer) uint64 { return c.Seccomp.Passed }},
		}
		for _, m := range perContainer {
			family(m.name, m.typ, m.help)
			for _, c := range s.Containers {
				fmt.Fprintf(b, "%s{container=%q,ip=%q} %d\n", m.name, c.ContainerID, c.IP, m.value(c))
			}
		}
	}
	return b.String()
}
