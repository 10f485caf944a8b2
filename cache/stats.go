package cache

import (
	"fmt"

	"net"
	"net/netip"
	"sort"

	"github.com/skiffnet/skiff/api"
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

// Reasons is indexed by enum reason.
var Reasons = []Reason{
	r("from_container", "hit"),
	r("from_container", "pass_not_ipv4"),
	r("from_container", "pass_unsupported"),
	r("from_container", "pass_not_remote"),
	r("from_container", "pass_syn_fin_rst"),
	r("from_container", "pass_ttl"),
	r("from_container", "pass_reverse_check"),
	r("from_container", "miss_filter"),
	r("from_container", "miss_egress_ip"),
	r("from_container", "miss_egress_host"),
	r("from_container", "error_encap"),
	r("from_container", "forged_marks_cleared"),
	r("from_underlay", "hit"),
	r("from_underlay", "pass_not_vxlan"),
	r("from_underlay", "pass_not_mine"),
	r("from_underlay", "pass_unsupported"),
	r("from_underlay", "pass_syn_fin_rst"),
	r("from_underlay", "pass_ttl"),
	r("from_underlay", "pass_reverse_check"),
	r("from_underlay", "miss_filter"),
	r("from_underlay", "miss_ingress"),
	r("from_underlay", "error_decap"),
	r("to_underlay", "learn"),
	r("to_underlay", "paused"),
	r("to_underlay", "marks_cleared"),
	r("to_underlay", "pass"),
	r("to_underlay", "pass_not_overlay"),
	r("to_container", "learn"),
	r("to_container", "paused"),
	r("to_container", "marks_cleared"),
	r("to_container", "pass"),
}

// Entries lists every cache entry.
func (c *Cache) Entries() (api.CacheEntries, error) {
	var out api.CacheEntries
	var k, v [4]byte
	it := c.objs.SkcEgressIp.Iterate()
	for it.Next(&k, &v) {
		out.EgressIPs = append(out.EgressIPs, api.EgressIP{Container: addr(k), Host: addr(v)})
	}
	var hv skcEgressHost
	it2 := c.objs.SkcEgressHost.Iterate()
	for it2.Next(&k, &hv) {
		h := hv.Hdr
		out.EgressHosts = append(out.EgressHosts, api.EgressHost{
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
		out.Ingress = append(out.Ingress, api.Ingress{Container: addr(k), Ifindex: ev.Ifindex,
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
		out.Flows = append(out.Flows, api.Flow{
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
	return out, nil
}
