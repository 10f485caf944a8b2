package agent

import (
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"

	"github.com/skiffnet/skiff/api"
)

// value returns the value of the metric name whose labels include want.
func value(t *testing.T, text, name string, want map[string]string) float64 {
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

func TestRenderSocketsMetrics(t *testing.T) {
	st := api.Status{Ready: true, Endpoints: 2, Layers: []api.Layer{{Name: "cache", Reason: "no connection tracking"}, {Name: "sockets", On: true}}, Sockets: &api.SocketsStatus{
		Counters:  map[string]uint64{"connect_fast": 7, "connect_denied": 0, "syn_spoofed": 2},
		Listeners: []string{"10.244.1.2:80", "10.244.1.3:11211"},
		Policy:    &api.SocketsPolicy{Rules: 3},
		Containers: []api.SocketsContainer{
			{ContainerID: "c1", IP: "10.244.1.2", Broker: true, HandedOut: 64, Replaced: 40, Fallback: 1,
				Seccomp: api.SocketsSeccomp{Listeners: 2, Replaced: 30, Fallback: 4, Passed: 9}},
			{ContainerID: "c2", IP: "10.244.1.3"},
		},
	}}
	text := renderMetrics(st)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"skiff_ready", nil, 1},
		{"skiff_endpoints", nil, 2},
		{"skiff_layer_on", map[string]string{"layer": "sockets"}, 1},
		{"skiff_layer_on", map[string]string{"layer": "cache"}, 0},
		{"skiff_sockets_events_total", map[string]string{"event": "connect_fast"}, 7},
		{"skiff_sockets_events_total", map[string]string{"event": "syn_spoofed"}, 2},
		{"skiff_sockets_events_total", map[string]string{"event": "connect_denied"}, 0},
		{"skiff_sockets_listeners", nil, 2},
		{"skiff_sockets_policy_in_force", nil, 1},
		{"skiff_sockets_policy_rules", nil, 3},
		{"skiff_sockets_broker_up", map[string]string{"container": "c1", "ip": "10.244.1.2"}, 1},
		{"skiff_sockets_broker_up", map[string]string{"container": "c2"}, 0},
		{"skiff_sockets_handed_out_total", map[string]string{"container": "c1"}, 64},
		{"skiff_sockets_replaced_total", map[string]string{"container": "c1"}, 40},
		{"skiff_sockets_fallback_total", map[string]string{"container": "c1"}, 1},
		{"skiff_sockets_fallback_total", map[string]string{"container": "c2"}, 0},
		{"skiff_sockets_seccomp_listeners", map[string]string{"container": "c1"}, 2},
		{"skiff_sockets_seccomp_replaced_total", map[string]string{"container": "c1"}, 30},
		{"skiff_sockets_seccomp_fallback_total", map[string]string{"container": "c1"}, 4},
		{"skiff_sockets_seccomp_passed_total", map[string]string{"container": "c2"}, 0},
	} {
		if got := value(t, text, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %g, want %g", c.name, c.labels, got, c.want)
		}
	}
	// More rules than the layer takes, or none written: every connection
	// takes the overlay.
	st.Sockets.Policy.Overflow = true
	if got := value(t, renderMetrics(st), "skiff_sockets_policy_in_force", nil); got != 0 {
		t.Errorf("policy in force with an overflow: %g", got)
	}
	st.Sockets.Policy = nil
	text = renderMetrics(st)
	if value(t, text, "skiff_sockets_policy_in_force", nil) != 0 || value(t, text, "skiff_sockets_policy_rules", nil) != 0 {
		t.Error("a policy in force without one")
	}
	// Other modes have no sockets families.
	if text := renderMetrics(api.Status{}); strings.Contains(text, "skiff_sockets") {
		t.Errorf("sockets metrics without the layer:\n%s", text)
	}
}

func TestRenderSourceDrops(t *testing.T) {
	text := renderMetrics(api.Status{SourceDrops: map[string]uint64{"ip_source": 5, "arp_sender": 1}})
	for reason, want := range map[string]float64{"ip_source": 5, "arp_sender": 1, "mac_source": 0} {
		if got := value(t, text, "skiff_source_check_drops_total", map[string]string{"reason": reason}); got != want {
			t.Errorf("%s: %v, want %v", reason, got, want)
		}
	}
	if strings.Contains(renderMetrics(api.Status{}), "skiff_source_check") {
		t.Error("source check metrics without counters")
	}
}

// TestRenderChannelsAndQoSMetrics: the channels layer's counters and map
// size, and the QoS marking counters, as Prometheus reads them.
func TestRenderChannelsAndQoSMetrics(t *testing.T) {
	st := api.Status{Channels: &api.ChannelsStatus{Counters: map[string]uint64{"redirected": 7, "added": 4}, Sockets: 2},
		QoS: map[string]uint64{"marked": 9, "unclassed": 1}}
	text := renderMetrics(st)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"skiff_channels_events_total", map[string]string{"event": "redirected"}, 7},
		{"skiff_channels_sockets", nil, 2},
		{"skiff_qos_packets_total", map[string]string{"outcome": "marked"}, 9},
	} {
		if got := value(t, text, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}
