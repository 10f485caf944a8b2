package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/skiffnet/skiff/cache"
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
	st := a.Status(ctx)
	b := &strings.Builder{}
	gauge := func(name, help string, v float64) {
		fmt.Fprintf(b, "# HELP %s %s\n# TYPE %s gauge\n%s %g\n", name, help, name, name, v)
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
	if st.Cache != nil {
		fmt.Fprintf(b, "# HELP skiff_cache_packets_total Packets handled by the cache programs, by program and outcome.\n# TYPE skiff_cache_packets_total counter\n")
		reasons := append([]cache.Reason(nil), cache.Reasons...)
		sort.Slice(reasons, func(i, j int) bool { return reasons[i].Name < reasons[j].Name })
		for _, r := range reasons {
			fmt.Fprintf(b, "skiff_cache_packets_total{program=%q,outcome=%q} %d\n", r.Program, r.Outcome, st.Cache[r.Name])
		}
	}
	w.Write([]byte(b.String()))
}
