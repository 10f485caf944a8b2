package agent

import (
	"strings"
	"testing"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/layer/layertest"
)

func TestAgentMetrics(t *testing.T) {
	st := api.Status{Ready: true, Endpoints: 2, Layers: []api.Layer{{Name: "cache", Reason: "no connection tracking"}, {Name: "sockets", On: true}},
		QoS: map[string]uint64{"marked": 9, "unclassed": 1}, PolicyDenies: map[string]uint64{"no-web": 3}}
	text := layertest.Text(t, agentMetrics(st))
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"skiff_ready", nil, 1},
		{"skiff_endpoints", nil, 2},
		{"skiff_layer_on", map[string]string{"layer": "sockets"}, 1},
		{"skiff_layer_on", map[string]string{"layer": "cache"}, 0},
		{"skiff_qos_packets_total", map[string]string{"outcome": "marked"}, 9},
		{"skiff_policy_denied_packets_total", map[string]string{"rule": "no-web"}, 3},
	} {
		if got := layertest.Value(t, text, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %g, want %g", c.name, c.labels, got, c.want)
		}
	}
}

func TestRenderSourceDrops(t *testing.T) {
	text := layertest.Text(t, agentMetrics(api.Status{SourceDrops: map[string]uint64{"ip_source": 5, "arp_sender": 1}}))
	for reason, want := range map[string]float64{"ip_source": 5, "arp_sender": 1, "mac_source": 0} {
		if got := layertest.Value(t, text, "skiff_source_check_drops_total", map[string]string{"reason": reason}); got != want {
			t.Errorf("%s: %v, want %v", reason, got, want)
		}
	}
	if text := layertest.Text(t, agentMetrics(api.Status{})); strings.Contains(text, "skiff_source_check") || strings.Contains(text, "skiff_qos") {
		t.Errorf("source check or QoS metrics without counters:\n%s", text)
	}
}
