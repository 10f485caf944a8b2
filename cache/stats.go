package cache

import (
	"fmt"
	"slices"
	"strings"

	"net"
	"net/netip"
	"sort"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/layer"
)

// Reason names a counter: which program, and what it did with a packet.
// The order is enum reason in cache.h.
type Reason struct {
	Name    string // program/outcome
	Program string
	Outcome string
}

func r(program, outcome string) Reason {
	return Reason{Name: program + "/" + outcome, Program: program, Outcome: outcome}
}

// Reasons is indexed by enum reason (cache.h): each name is keyed by the
// constant bpf2go generates from the enum, so a renamed or removed reason
// does not compile and a new one without a name fails TestReasonsMatchProgram.
var Reasons = reasons[:]

var reasons = [skcReasonNR_REASONS]Reason{
	skcReasonEG_HIT:              r("from_container", "hit"),
	skcReasonEG_PASS_NOT_IP:      r("from_container", "pass_not_ipv4"),
	skcReasonEG_PASS_UNSUPPORTED: r("from_container", "pass_unsupported"),
	skcReasonEG_PASS_NOT_REMOTE:  r("from_container", "pass_not_remote"),
	skcReasonEG_PASS_CONTROL:     r("from_container", "pass_syn_fin_rst"),
	skcReasonEG_PASS_TTL:         r("from_container", "pass_ttl"),
	skcReasonEG_PASS_REVERSE:     r("from_container", "pass_reverse_check"),
	skcReasonEG_MISS_FILTER:      r("from_container", "miss_filter"),
	skcReasonEG_MISS_EGRESS_IP:   r("from_container", "miss_egress_ip"),
	skcReasonEG_MISS_EGRESS_HOST: r("from_container", "miss_egress_host"),
	skcReasonEG_ERR_ENCAP:        r("from_container", "error_encap"),
	skcReasonEG_FORGED_MARKS:     r("from_container", "forged_marks_cleared"),
	skcReasonEG_FLOW_FORGOTTEN:   r("from_container", "syn_flow_forgotten"),
	skcReasonEG_TABLE_HIT:        r("from_container", "table_hit"),
	skcReasonEG_TABLE_OPEN:       r("from_container", "table_open"),
	skcReasonEG_NEW_DENIED:       r("from_container", "new_denied"),
	skcReasonEG_NEW_UNJUDGED:     r("from_container", "new_unjudged"),
	skcReasonEG_NO_PATH:          r("from_container", "table_no_path"),
	skcReasonEG_TABLE_FULL:       r("from_container", "table_full"),
	skcReasonEG_NEW_TRACKED:      r("from_container", "new_tracked"),
	skcReasonLO_TABLE_HIT:        r("from_container", "local_table_hit"),
	skcReasonLO_TABLE_OPEN:       r("from_container", "local_table_open"),
	skcReasonLO_NEW_DENIED:       r("from_container", "local_new_denied"),
	skcReasonLO_NEW_UNJUDGED:     r("from_container", "local_new_unjudged"),
	skcReasonLO_NO_PATH:          r("from_container", "local_no_path"),
	skcReasonLO_NEW_NO_LISTENER:  r("from_container", "local_new_no_listener"),
	skcReasonLO_TABLE_FULL:       r("from_container", "local_table_full"),
	skcReasonLO_NEW_TRACKED:      r("from_container", "local_new_tracked"),
	skcReasonLO_PASS:             r("from_container", "local_pass"),
	skcReasonLO_ERR:              r("from_container", "local_error"),
	skcReasonIN_HIT:              r("from_underlay", "hit"),
	skcReasonIN_PASS_NOT_VXLAN:   r("from_underlay", "pass_not_vxlan"),
	skcReasonIN_PASS_NOT_MINE:    r("from_underlay", "pass_not_mine"),
	skcReasonIN_PASS_UNSUPPORTED: r("from_underlay", "pass_unsupported"),
	skcReasonIN_PASS_CONTROL:     r("from_underlay", "pass_syn_fin_rst"),
	skcReasonIN_PASS_TTL:         r("from_underlay", "pass_ttl"),
	skcReasonIN_PASS_REVERSE:     r("from_underlay", "pass_reverse_check"),
	skcReasonIN_MISS_FILTER:      r("from_underlay", "miss_filter"),
	skcReasonIN_MISS_INGRESS:     r("from_underlay", "miss_ingress"),
	skcReasonIN_ERR_DECAP:        r("from_underlay", "error_decap"),
	skcReasonIN_FLOW_FORGOTTEN:   r("from_underlay", "syn_flow_forgotten"),
	skcReasonIN_HIT_SHAPED:       r("from_underlay", "hit_shaped"),
	skcReasonIN_TABLE_HIT:        r("from_underlay", "table_hit"),
	skcReasonIN_TABLE_OPEN:       r("from_underlay", "table_open"),
	skcReasonIN_NEW_DENIED:       r("from_underlay", "new_denied"),
	skcReasonIN_NEW_UNJUDGED:     r("from_underlay", "new_unjudged"),
	skcReasonIN_NO_PATH:          r("from_underlay", "table_no_path"),
	skcReasonIN_NEW_NO_LISTENER:  r("from_underlay", "new_no_listener"),
	skcReasonIN_TABLE_FULL:       r("from_underlay", "table_full"),
	skcReasonIN_NEW_TRACKED:      r("from_underlay", "new_tracked"),
	skcReasonIN_RESTORED:         r("from_underlay", "restored"),
	skcReasonIN_RW_TO_OVERLAY:    r("from_underlay", "restored_to_overlay"),
	skcReasonIN_RW_UNKNOWN_KEY:   r("from_underlay", "rewrite_unknown_key"),
	skcReasonIN_RW_DEAD_KEY:      r("from_underlay", "rewrite_dead_key"),
	skcReasonIN_RW_SPOOFED:       r("from_underlay", "rewrite_spoofed"),
	skcReasonEG_REWRITTEN:        r("from_container", "rewritten"),
	skcReasonEG_RW_KEYS_FULL:     r("from_container", "rewrite_keys_full"),
	skcReasonEG_TOO_BIG:          r("from_container", "too_big_for_vxlan"),
	skcReasonEI_SCRUBBED:         r("to_underlay", "scrubbed"),
	skcReasonEI_LEARN:            r("to_underlay", "learn"),
	skcReasonEI_PAUSED:           r("to_underlay", "paused"),
	skcReasonEI_CLEARED:          r("to_underlay", "marks_cleared"),
	skcReasonEI_PASS:             r("to_underlay", "pass"),
	skcReasonEI_PASS_NOT_OVERLAY: r("to_underlay", "pass_not_overlay"),
	skcReasonII_LEARN:            r("to_container", "learn"),
	skcReasonII_PAUSED:           r("to_container", "paused"),
	skcReasonII_CLEARED:          r("to_container", "marks_cleared"),
	skcReasonII_PASS:             r("to_container", "pass"),
}

// Entries lists every cache entry.
func (c *fastPath) Entries() (Entries, error) {
	var out Entries
	var k, v [4]byte
	it := c.objs.SkcEgressIp.Iterate()
	for it.Next(&k, &v) {
		out.EgressIPs = append(out.EgressIPs, EgressIP{Container: addr(k), Host: addr(v)})
	}
	var hv skcEgressHost
	it2 := c.objs.SkcEgressHost.Iterate()
	for it2.Next(&k, &hv) {
		h := hv.Hdr
		out.EgressHosts = append(out.EgressHosts, EgressHost{
			Host: addr(k), Ifindex: hv.Ifindex,
			OuterDst: net.HardwareAddr(h[0:6]).String(), OuterSrc: net.HardwareAddr(h[6:12]).String(),
			UDPDstPrt: uint16(h[36])<<8 | uint16(h[37]),
			VNI:       uint32(h[46])<<16 | uint32(h[47])<<8 | uint32(h[48]),
			InnerDst:  net.HardwareAddr(h[50:56]).String(), InnerSrc: net.HardwareAddr(h[56:62]).String(),
		})
	}
	var ev skcIngressEp
	it3 := c.objs.SkcIngress.Iterate()
	for it3.Next(&k, &ev) {
		out.Ingress = append(out.Ingress, Ingress{Container: addr(k), Ifindex: ev.Ifindex,
			MACDst: net.HardwareAddr(ev.MacDst[:]).String(), MACSrc: net.HardwareAddr(ev.MacSrc[:]).String(), Ready: ev.Ready != 0})
	}
	var fk skcFlowKey
	var fv skcFilterVal
	it4 := c.objs.SkcFilter.Iterate()
	for it4.Next(&fk, &fv) {
		proto := protoNames[fk.Proto]
		if proto == "" {
			proto = fmt.Sprint(fk.Proto)
		}
		out.Flows = append(out.Flows, Flow{
			Local:  netip.AddrPortFrom(addr32(fk.Laddr), ntohs(fk.Lport)).String(),
			Remote: netip.AddrPortFrom(addr32(fk.Raddr), ntohs(fk.Rport)).String(),
			Proto:  proto, Egress: fv.Egress != 0, Ingress: fv.Ingress != 0,
		})
	}
	sort.Slice(out.Flows, func(i, j int) bool {
		return out.Flows[i].Local+out.Flows[i].Remote < out.Flows[j].Local+out.Flows[j].Remote
	})
	for _, err := range []error{it.Err(), it2.Err(), it3.Err(), it4.Err()} {
		if err != nil {
			return out, fmt.Errorf("walk caches: %w", err)
		}
	}
	var err error
	out.TunnelPairs, out.TunnelKeys, err = c.tunnelEntries()
	return out, err
}

// Entries is a snapshot of the cache's maps, for skiff layer cache.
type Entries struct {
	EgressIPs   []EgressIP   `json:"egressIPs"`
	EgressHosts []EgressHost `json:"egressHosts"`
	Ingress     []Ingress    `json:"ingress"`
	Flows       []Flow       `json:"flows"`
	// Connections is the connection table's use (Inspect's), of
	// ConnectionCapacity.
	Connections        int    `json:"connections"`
	ConnectionCapacity uint32 `json:"connectionCapacity"`
	// The rewriting tunnel's pairs and the keys this host gave its peers.
	TunnelPairs []TunnelPair `json:"tunnelPairs,omitempty"`
	TunnelKeys  []TunnelKey  `json:"tunnelKeys,omitempty"`
}

// EgressIP maps a remote container to its host.
type EgressIP struct {
	Container netip.Addr `json:"container"`
	Host      netip.Addr `json:"host"`
}

// EgressHost is the cached encapsulation towards one host.
type EgressHost struct {
	Host      netip.Addr `json:"host"`
	Ifindex   uint32     `json:"ifindex"`
	OuterSrc  string     `json:"outerSrcMAC"`
	OuterDst  string     `json:"outerDstMAC"`
	InnerSrc  string     `json:"innerSrcMAC"`
	InnerDst  string     `json:"innerDstMAC"`
	VNI       uint32     `json:"vni"`
	UDPDstPrt uint16     `json:"udpDstPort"`
}

// Ingress is how a local container is reached.
type Ingress struct {
	Container netip.Addr `json:"container"`
	Ifindex   uint32     `json:"vethIfindex"`
	MACDst    string     `json:"macDst"`
	MACSrc    string     `json:"macSrc"`
	Ready     bool       `json:"ready"`
}

// Flow is one cached flow and the directions the overlay let through.
type Flow struct {
	Local   string `json:"local"`
	Remote  string `json:"remote"`
	Proto   string `json:"proto"`
	Egress  bool   `json:"egress"`
	Ingress bool   `json:"ingress"`
}

// classes are the table's flow classes, named as its metric's labels:
// TCP's states, and UDP's and ICMP's opened and replied.
var classes = []struct {
	class
	proto, state string
}{
	{class{unix.IPPROTO_TCP, stSynSent}, "tcp", "syn_sent"},
	{class{unix.IPPROTO_TCP, stSynRecv}, "tcp", "syn_recv"},
	{class{unix.IPPROTO_TCP, stEstablished}, "tcp", "established"},
	{class{unix.IPPROTO_TCP, stClosing}, "tcp", "closing"},
	{class{unix.IPPROTO_UDP, stSynSent}, "udp", "opened_out"},
	{class{unix.IPPROTO_UDP, stSynRecv}, "udp", "opened_in"},
	{class{unix.IPPROTO_UDP, stEstablished}, "udp", "replied"},
	{class{unix.IPPROTO_ICMP, stSynSent}, "icmp", "opened_out"},
	{class{unix.IPPROTO_ICMP, stSynRecv}, "icmp", "opened_in"},
	{class{unix.IPPROTO_ICMP, stEstablished}, "icmp", "replied"},
}

// report shows the counters in program order and the connection table's
// use, and serves them as skiff_cache_packets_total{program,outcome},
// skiff_cache_connections{proto,state} and skiff_cache_connections_capacity.
func report(stats map[string]uint64, conns map[class]int, capacity uint32) layer.Report {
	var rows [][]string
	for _, r := range Reasons {
		if n := stats[r.Name]; n > 0 {
			rows = append(rows, []string{r.Program, r.Outcome, fmt.Sprint(n)})
		}
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i][0] < rows[j][0] })
	m := layer.Metrics{Layer: "cache"}
	reasons := slices.SortedFunc(slices.Values(Reasons), func(a, b Reason) int { return strings.Compare(a.Name, b.Name) })
	m.Add("packets_total", "Packets handled by the cache programs, by program and outcome.", prometheus.CounterValue,
		[]string{"program", "outcome"}, len(reasons), func(i int) float64 { return float64(stats[reasons[i].Name]) },
		func(i int) []string { return []string{reasons[i].Program, reasons[i].Outcome} })
	m.Add("connections", "Flows in the fast path's connection table, by protocol and state.", prometheus.GaugeValue,
		[]string{"proto", "state"}, len(classes), func(i int) float64 { return float64(conns[classes[i].class]) },
		func(i int) []string { return []string{classes[i].proto, classes[i].state} })
	m.Gauge("connections_capacity", "Size of the fast path's connection table (a full table sends new flows to the overlay).", float64(capacity))
	total := 0
	var tableRows [][]string
	for _, c := range classes {
		n := conns[c.class]
		total += n
		if n > 0 || c.proto == "tcp" {
			tableRows = append(tableRows, []string{c.proto, c.state, fmt.Sprint(n)})
		}
	}
	tableRows = append(tableRows, []string{"total", "", fmt.Sprintf("%d of %d", total, capacity)})
	return layer.Report{Counters: stats, View: []api.Section{
		{Title: "cache fast path (packets):", Header: []string{"PROGRAM", "OUTCOME", "PACKETS"}, Rows: rows},
		{Title: "cache connection table:", Header: []string{"PROTO", "STATE", "FLOWS"}, Rows: tableRows},
	}, Metrics: m.List()}
}

// view shows the entries, a table for each map.
func (e Entries) view() []api.Section {
	var ips, hosts, ingress, flows [][]string
	for _, x := range e.EgressIPs {
		ips = append(ips, []string{x.Container.String(), x.Host.String()})
	}
	for _, x := range e.EgressHosts {
		hosts = append(hosts, []string{x.Host.String(), fmt.Sprint(x.Ifindex), x.OuterSrc + " → " + x.OuterDst,
			fmt.Sprint(x.VNI), x.InnerSrc + " → " + x.InnerDst})
	}
	for _, x := range e.Ingress {
		ingress = append(ingress, []string{x.Container.String(), fmt.Sprint(x.Ifindex), x.MACSrc + " → " + x.MACDst, fmt.Sprint(x.Ready)})
	}
	for _, x := range e.Flows {
		flows = append(flows, []string{x.Proto, x.Local, x.Remote, fmt.Sprint(x.Egress), fmt.Sprint(x.Ingress)})
	}
	var pairs, keys [][]string
	for _, x := range e.TunnelPairs {
		pairs = append(pairs, []string{x.Local.String(), x.Remote.String(), fmt.Sprint(x.Send), fmt.Sprint(x.Recv), fmt.Sprint(x.Pending)})
	}
	for _, x := range e.TunnelKeys {
		keys = append(keys, []string{x.Peer.String(), fmt.Sprint(x.Key), x.Remote.String() + " → " + x.Local.String(), fmt.Sprint(x.Dead)})
	}
	tunnel := []api.Section{
		{Title: fmt.Sprintf("rewriting tunnel: pairs (%d)", len(pairs)), Header: []string{"LOCAL", "REMOTE", "SEND KEY", "RECEIVE KEY", "ADVERTISING"}, Rows: pairs},
		{Title: fmt.Sprintf("rewriting tunnel: keys given (%d)", len(keys)), Header: []string{"PEER", "KEY", "RESTORES", "DEAD"}, Rows: keys},
	}
	if len(pairs)+len(keys) == 0 {
		tunnel = nil
	}
	return append([]api.Section{
		{Title: fmt.Sprintf("egress: container → host (%d)", len(ips)), Header: []string{"CONTAINER", "HOST"}, Rows: ips},
		{Title: fmt.Sprintf("egress: host → headers (%d)", len(hosts)), Header: []string{"HOST", "IFINDEX", "OUTER MACS", "VNI", "INNER MACS"}, Rows: hosts},
		{Title: fmt.Sprintf("ingress: local container (%d)", len(ingress)), Header: []string{"CONTAINER", "VETH IFINDEX", "MACS", "READY"}, Rows: ingress},
		{Title: fmt.Sprintf("flows (%d)", len(flows)), Header: []string{"PROTO", "LOCAL", "REMOTE", "EGRESS", "INGRESS"}, Rows: flows},
	}, tunnel...)
}
