package sockets

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/layer/layertest"
)

// TestStatusPolicy: status says whether the sockets layer judges the
// policy at connect, or sends every connection to the overlay.
func TestStatusPolicy(t *testing.T) {
	for _, tc := range []struct {
		policy *Policy
		want   string
	}{
		{nil, "fast-path policy: none in force: every connection takes the overlay"},
		{&Policy{Rules: 3}, "fast-path policy: 3 TCP rules, judged at connect"},
		{&Policy{Rules: 1024, Overflow: true}, "fast-path policy: more than 1024 TCP rules: every connection takes the overlay"},
	} {
		view := (&Status{Policy: tc.policy}).report().View
		if len(view) == 0 || !strings.Contains(strings.Join(view[0].Lines, "\n")+"\n", tc.want+"\n") {
			t.Errorf("policy %+v: %+v\nwant the line %q", tc.policy, view, tc.want)
		}
	}
}

func TestStatusMetrics(t *testing.T) {
	s := &Status{
		Counters:  map[string]uint64{"connect_fast": 7, "connect_denied": 0, "syn_spoofed": 2},
		Listeners: []string{"10.244.1.2:80", "10.244.1.3:11211"},
		Policy:    &Policy{Rules: 3},
		Containers: []Container{
			{ContainerID: "c1", IP: "10.244.1.2", Broker: true, HandedOut: 64, Replaced: 40, Fallback: 1, Ports: 2,
				Seccomp: ContainerSeccomp{Listeners: 2, Replaced: 30, Fallback: 4, Passed: 9}},
			{ContainerID: "c2", IP: "10.244.1.3"},
		},
	}
	text := layertest.Text(t, s.report().Metrics)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"skiff_sockets_events_total", map[string]string{"event": "connect_fast"}, 7},
		{"skiff_sockets_events_total", map[string]string{"event": "syn_spoofed"}, 2},
		{"skiff_sockets_events_total", map[string]string{"event": "connect_denied"}, 0},
		{"skiff_sockets_listeners", nil, 2},
		{"skiff_sockets_policy_in_force", nil, 1},
		{"skiff_sockets_policy_rules", nil, 3},
		{"skiff_sockets_broker_up", map[string]string{"container": "c1", "ip": "10.244.1.2"}, 1},
		{"skiff_sockets_broker_up", map[string]string{"container": "c2"}, 0},
		{"skiff_sockets_ports", map[string]string{"container": "c1"}, 2},
		{"skiff_sockets_handed_out_total", map[string]string{"container": "c1"}, 64},
		{"skiff_sockets_replaced_total", map[string]string{"container": "c1"}, 40},
		{"skiff_sockets_fallback_total", map[string]string{"container": "c1"}, 1},
		{"skiff_sockets_fallback_total", map[string]string{"container": "c2"}, 0},
		{"skiff_sockets_seccomp_listeners", map[string]string{"container": "c1"}, 2},
		{"skiff_sockets_seccomp_replaced_total", map[string]string{"container": "c1"}, 30},
		{"skiff_sockets_seccomp_fallback_total", map[string]string{"container": "c1"}, 4},
		{"skiff_sockets_seccomp_passed_total", map[string]string{"container": "c2"}, 0},
	} {
		if got := layertest.Value(t, text, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %g, want %g", c.name, c.labels, got, c.want)
		}
	}
	// More rules than the layer takes, or none written: every connection
	// takes the overlay.
	s.Policy.Overflow = true
	if got := layertest.Value(t, layertest.Text(t, s.report().Metrics), "skiff_sockets_policy_in_force", nil); got != 0 {
		t.Errorf("policy in force with an overflow: %g", got)
	}
	s.Policy = nil
	text = layertest.Text(t, s.report().Metrics)
	if layertest.Value(t, text, "skiff_sockets_policy_in_force", nil) != 0 || layertest.Value(t, text, "skiff_sockets_policy_rules", nil) != 0 {
		t.Error("a policy in force without one")
	}
}

// TestStatusOf: the status travels as the layer's details and counters,
// and StatusOf reads it back.
func TestStatusOf(t *testing.T) {
	s := &Status{Counters: map[string]uint64{"connect_fast": 7}, Listeners: []string{"10.244.1.2:80"}, ListenerQuota: 256,
		Containers: []Container{{ContainerID: "c1", Ports: 1}}}
	r := s.report()
	st := api.Status{Layers: []api.Layer{{Name: "cache", On: true}, {Name: "sockets", On: true, Counters: r.Counters, Details: mustJSON(t, r.Details)}}}
	got, err := StatusOf(st)
	if err != nil || got == nil || got.Counters["connect_fast"] != 7 || len(got.Listeners) != 1 || got.ListenerQuota != 256 || got.Containers[0].Ports != 1 {
		t.Fatalf("%+v, %v", got, err)
	}
	if got, err := StatusOf(api.Status{Layers: []api.Layer{{Name: "sockets", Reason: "off"}}}); got != nil || err != nil {
		t.Fatalf("a layer that is off: %+v, %v", got, err)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
