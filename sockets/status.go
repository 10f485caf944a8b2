package sockets

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/sockets/broker"
)

// Status is the sockets layer of one host (api.Layer.Details).
type Status struct {
	// Counters are the programs' (Reasons) and the rate limits' (limit_*),
	// by name: api.Layer.Counters.
	Counters   map[string]uint64 `json:"-"`
	Listeners  []string          `json:"listeners"` // overlay address:port of replaced listeners
	Containers []Container       `json:"containers"`
	Policy     *Policy           `json:"policy"` // null: none in force, every connection takes the overlay
	// ListenerQuota is the ports each container's host sockets may hold.
	ListenerQuota int `json:"listenerQuota"`
	// RoutesOver counts the cluster's published listeners this host has
	// no fast-path route for (its route map is full; each container gets
	// an equal share): connections to them take the overlay.
	RoutesOver int `json:"routesOver,omitempty"`
	// Publish is how this host's listeners reached the cluster store.
	Publish *Publish `json:"publish,omitempty"`
}

// Publish counts the writes of this host's replaced listeners to the
// cluster store (publisher: at once, but at most once a second in a loop
// of changes).
type Publish struct {
	Listeners int       `json:"listeners"` // in the store as last written
	Writes    uint64    `json:"writes"`    // writes of a changed set
	Last      time.Time `json:"last,omitzero"`
	Error     string    `json:"error,omitempty"` // of the last write, if it failed
}

// Container is one container's use of host sockets, as its broker counts
// it.
type Container struct {
	ContainerID string `json:"containerID"`
	IP          string `json:"ip"`
	Broker      bool   `json:"broker"`    // its broker runs
	Ports       int    `json:"ports"`     // ports its host sockets hold (bound or listening), against the quota
	HandedOut   uint64 `json:"handedOut"` // host sockets given to its processes
	Replaced    uint64 `json:"replaced"`  // connections and listeners on host sockets
	Fallback    uint64 `json:"fallback"`  // sockets that fell back to the overlay
	// Privileged is a process of the container that holds CAP_NET_ADMIN or
	// CAP_SYS_ADMIN in the host's user namespace: its broker refuses the
	// container host sockets (secure mode). 0 if none.
	Privileged int `json:"privileged,omitempty"`
	// Seccomp is what its broker did with the connect() and listen()
	// calls of processes under skiff's seccomp profile (no preload).
	Seccomp ContainerSeccomp `json:"seccomp"`
}

// ContainerSeccomp counts a container's calls its broker served through
// the seccomp agent.
type ContainerSeccomp struct {
	Listeners  uint64  `json:"listeners"`  // notification listeners served now
	Replaced   uint64  `json:"replaced"`   // connections and listeners moved to host sockets
	Fallback   uint64  `json:"fallback"`   // in the cluster, left on the container's socket
	Passed     uint64  `json:"passed"`     // not for the fast path: continued untouched
	Dropped    uint64  `json:"dropped"`    // the caller went while handled
	MeanMicros float64 `json:"meanMicros"` // mean time to answer one
}

// StatusOf reads the sockets layer's status from a host's status: nil
// when the layer does not run there.
func StatusOf(st api.Status) (*Status, error) {
	s, l, err := layer.DetailsOf[Status](st, "sockets")
	if s != nil {
		s.Counters = l.Counters
	}
	return s, err
}

// Status reports the layer's counters, listeners and containers.
func (a *Layer) Status(local []cluster.Endpoint) layer.Report {
	s := &Status{ListenerQuota: a.l.cfg.quota(), Publish: a.publisher.stats(), RoutesOver: int(a.l.routesOver.Load())}
	s.Counters, _ = a.l.Stats()
	s.Policy, _ = a.l.PolicyInForce()
	if ls, err := a.l.LocalListeners(); err == nil {
		for _, l := range ls {
			s.Listeners = append(s.Listeners, l.Addr.String())
		}
	}
	for _, e := range local {
		if !replaced(e) {
			continue
		}
		c := Container{ContainerID: e.ContainerID, IP: e.IP.Addr().String(), Ports: a.l.Held(e.IP.Addr())}
		bs := broker.ReadStats(a.stateDir, e.ContainerID)
		c.HandedOut, c.Replaced, c.Fallback, c.Privileged = bs.HandedOut, bs.Replaced, bs.Fallback, bs.Privileged
		c.Seccomp = ContainerSeccomp{Listeners: bs.Seccomp.Listeners, Replaced: bs.Seccomp.Replaced,
			Fallback: bs.Seccomp.Fallback, Passed: bs.Seccomp.Passed, Dropped: bs.Seccomp.Dropped}
		if bs.Seccomp.Handled > 0 {
			c.Seccomp.MeanMicros = float64(bs.Seccomp.Nanos) / float64(bs.Seccomp.Handled) / 1e3
		}
		c.Broker = a.l.BrokerRunning(e.ContainerID)
		s.Containers = append(s.Containers, c)
	}
	return s.report()
}

func (s *Status) report() layer.Report {
	return layer.Report{Counters: s.Counters, Details: s, View: s.view(), Metrics: s.metrics()}
}

// view is how skiff status shows the layer: listeners, publishing, routes,
// policy, containers, counters.
func (s *Status) view() []api.Section {
	lines := []string{"replaced listeners: " + strings.Join(s.Listeners, " ")}
	if p := s.Publish; p != nil {
		line := fmt.Sprintf("published: %d listeners, %d writes", p.Listeners, p.Writes)
		if !p.Last.IsZero() {
			line += fmt.Sprintf(", last %s ago", time.Since(p.Last).Round(time.Second))
		}
		if p.Error != "" {
			line += ", FAILING: " + p.Error
		}
		lines = append(lines, line)
	}
	if s.RoutesOver > 0 {
		lines = append(lines, fmt.Sprintf("fast-path routes: FULL, %d published listeners take the overlay", s.RoutesOver))
	}
	switch p := s.Policy; {
	case p == nil:
		lines = append(lines, "fast-path policy: none in force: every connection takes the overlay")
	case p.Overflow:
		lines = append(lines, fmt.Sprintf("fast-path policy: more than %d TCP rules: every connection takes the overlay", p.Rules))
	default:
		lines = append(lines, fmt.Sprintf("fast-path policy: %d TCP rules, judged at connect", p.Rules))
	}
	var rows [][]string
	for _, c := range s.Containers {
		broker := "running"
		switch {
		case !c.Broker:
			broker = "DOWN"
		case c.Privileged != 0:
			broker = fmt.Sprintf("refused (pid %d holds NET_ADMIN/SYS_ADMIN)", c.Privileged)
		}
		sc := c.Seccomp
		rows = append(rows, []string{c.ContainerID, c.IP, broker, fmt.Sprintf("%d/%d", c.Ports, s.ListenerQuota), fmt.Sprint(c.HandedOut), fmt.Sprint(c.Replaced),
			fmt.Sprint(c.Fallback), fmt.Sprint(sc.Listeners), fmt.Sprint(sc.Replaced), fmt.Sprint(sc.Fallback), fmt.Sprint(sc.Passed)})
	}
	// The layer's events in their order, then its rate limits' (limit_*).
	var limits []string
	for name := range s.Counters {
		if strings.HasPrefix(name, "limit_") {
			limits = append(limits, name)
		}
	}
	slices.Sort(limits)
	names := slices.Concat(Reasons(), limits) // Reasons() is shared: never appended to
	return []api.Section{
		{Lines: lines},
		// ports: bound or listening, against the quota; preload: the
		// shim's counts; seccomp: the broker's, for processes under
		// skiff's seccomp profile
		{Header: []string{"CONTAINER", "IP", "BROKER", "PORTS", "HANDED OUT", "PRELOAD REPLACED", "PRELOAD FALLBACK",
			"SECCOMP LISTENERS", "SECCOMP REPLACED", "SECCOMP FALLBACK", "SECCOMP PASSED"}, Rows: rows},
		{Title: "sockets layer (events):", Header: []string{"COUNTER", "COUNT"}, Rows: layer.CounterRows(names, s.Counters)},
	}
}

// metrics are the layer's Prometheus metrics.
func (s *Status) metrics() []prometheus.Metric {
	m := layer.Metrics{Layer: "sockets"}
	m.Counters("events_total", "Events of the sockets layer's programs (docs/sockets.md, Operating it).", "event", s.Counters)
	m.Gauge("listeners", "Replaced listeners on this host.", float64(len(s.Listeners)))
	rules, inForce := 0, 0.0
	if s.Policy != nil {
		rules = s.Policy.Rules
		if !s.Policy.Overflow {
			inForce = 1
		}
	}
	m.Gauge("policy_in_force", "Whether connect judges new fast-path connections by a policy; 0: every connection takes the overlay.", inForce)
	m.Gauge("policy_rules", "TCP rules of the policy the sockets layer judges connections by.", float64(rules))
	m.Gauge("listener_quota", "Ports each container's host sockets may hold, bound or listening.", float64(s.ListenerQuota))
	m.Gauge("routes_over", "Published listeners of the cluster without a fast-path route here (the route map full).", float64(s.RoutesOver))
	if p := s.Publish; p != nil {
		m.Add("publish_writes_total", "Writes of this host's replaced listeners to the cluster store.", prometheus.CounterValue, nil, 1,
			func(int) float64 { return float64(p.Writes) }, nil)
	}
	boolean := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	c := s.Containers
	labels := func(i int) []string { return []string{c[i].ContainerID, c[i].IP} }
	for _, f := range []struct {
		name  string
		typ   prometheus.ValueType
		help  string
		value func(Container) float64
	}{
		{"broker_up", prometheus.GaugeValue, "Whether the container's socket broker runs.", func(c Container) float64 { return boolean(c.Broker) }},
		{"ports", prometheus.GaugeValue, "Ports the container's host sockets hold, bound or listening (against the listener quota).", func(c Container) float64 { return float64(c.Ports) }},
		{"handed_out_total", prometheus.CounterValue, "Host sockets the broker gave the container's processes.", func(c Container) float64 { return float64(c.HandedOut) }},
		{"replaced_total", prometheus.CounterValue, "Connections and listeners of the container on host sockets, as its shims report them.", func(c Container) float64 { return float64(c.Replaced) }},
		{"fallback_total", prometheus.CounterValue, "Sockets of the container that fell back to the overlay, as its shims report them.", func(c Container) float64 { return float64(c.Fallback) }},
		{"seccomp_listeners", prometheus.GaugeValue, "Seccomp listeners of the container's processes its broker serves (skiff's seccomp profile).", func(c Container) float64 { return float64(c.Seccomp.Listeners) }},
		{"seccomp_replaced_total", prometheus.CounterValue, "connect and listen calls the broker's seccomp agent moved to host sockets.", func(c Container) float64 { return float64(c.Seccomp.Replaced) }},
		{"seccomp_fallback_total", prometheus.CounterValue, "connect and listen calls in the cluster the seccomp agent left on the container's socket.", func(c Container) float64 { return float64(c.Seccomp.Fallback) }},
		{"seccomp_passed_total", prometheus.CounterValue, "connect and listen calls the seccomp agent continued untouched (not for the fast path).", func(c Container) float64 { return float64(c.Seccomp.Passed) }},
	} {
		m.Add(f.name, f.help, f.typ, []string{"container", "ip"}, len(c), func(i int) float64 { return f.value(c[i]) }, labels)
	}
	return m.List()
}
