package overlay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/iptables"
)

// The guard: what no container may reach, whatever the policy says. Its
// chains are jumped to before skiff's policy chains, and user policy cannot
// add to or override them (docs/security.md).
//
//	SKIFF-GUARD-IN   INPUT, packets from containers (arriving on the bridge,
//	                 or from an overlay address): the VXLAN port and every
//	                 control-plane port of this host (store client and peer,
//	                 metrics), on any of its addresses.
//	SKIFF-GUARD-FWD  FORWARD, packets from this host's containers leaving
//	                 the overlay: the VXLAN port of any address, and the
//	                 control-plane endpoints of the store and of every host.
//	SKIFF-VXLAN      INPUT, VXLAN to this host: only from cluster hosts'
//	                 underlay addresses, and from each only for its own
//	                 containers (the inner source, when in the cluster).
const (
	chainGuardIn  = "SKIFF-GUARD-IN"
	chainGuardFwd = "SKIFF-GUARD-FWD"
	chainVXLAN    = "SKIFF-VXLAN"
)

// ControlPlane is what containers must never reach.
type ControlPlane struct {
	// Ports served on this host (any of its addresses): refused to
	// containers here whatever address they use.
	Ports []uint16
	// Endpoints served elsewhere (an external store, the lab's).
	Endpoints []netip.AddrPort
}

// guardHooks are the jumps into the guard chains, first in their built-in
// chains. INPUT takes what comes from the bridge (a spoofed source still
// arrives there) and from any overlay address (other hosts' containers,
// decapsulated or readdressed to the host stack by a layer); FORWARD takes
// this host's containers' (the bridge): beyond the overlay, other hosts'
// containers are their hosts' to judge.
func (o *Overlay) guardHooks() []iptables.Jump {
	cidr := o.cfg.Cluster.CIDR.String()
	port := fmt.Sprint(o.cfg.Cluster.VXLANPort)
	comment := []string{"-m", "comment", "--comment", "skiff guard"}
	return []iptables.Jump{
		{From: "INPUT", Rule: slices.Concat([]string{"-i", BridgeName}, comment, []string{"-j", chainGuardIn})},
		{From: "INPUT", Rule: slices.Concat([]string{"!", "-i", "lo", "-s", cidr}, comment, []string{"-j", chainGuardIn})},
		{From: "INPUT", Rule: slices.Concat([]string{"-p", "udp", "--dport", port}, comment, []string{"-j", chainVXLAN})},
		{From: "FORWARD", Rule: slices.Concat([]string{"-i", BridgeName}, comment, []string{"-j", chainGuardFwd})},
	}
}

// setupGuard creates the guard chains if missing — keeping their rules, so
// a restarting agent that cannot reach the store keeps the last ones — and
// hooks them in.
func (o *Overlay) setupGuard() error {
	for _, c := range []string{chainGuardIn, chainGuardFwd, chainVXLAN} {
		if err := iptables.NewChain("filter", c); err != nil {
			return err
		}
	}
	var errs []error
	for _, h := range o.guardHooks() {
		errs = append(errs, iptables.Insert("filter", h.From, h.Rule...))
	}
	return errors.Join(errs...)
}

// SyncGuard rewrites the guard chains for the control plane cp and the
// cluster's hosts, atomically.
func (o *Overlay) SyncGuard(cp ControlPlane, hosts []cluster.Host) error {
	rules := o.guardRules(cp, hosts)
	if rules == o.guard {
		return nil
	}
	if err := iptables.Restore(rules); err != nil {
		return err
	}
	o.guard = rules
	return nil
}

// guardRules renders the guard chains (iptables-restore input).
func (o *Overlay) guardRules(cp ControlPlane, hosts []cluster.Host) string {
	cidr := o.cfg.Cluster.CIDR.String()
	vx := o.cfg.Cluster.VXLANPort
	var b strings.Builder
	b.WriteString("*filter\n")
	for _, c := range []string{chainGuardIn, chainGuardFwd, chainVXLAN} {
		fmt.Fprintf(&b, ":%s - [0:0]\n", c)
	}
	// A container's VXLAN frame to a host would be decapsulated there with
	// any inner source it chose.
	fmt.Fprintf(&b, "-A %s -p udp --dport %d -j DROP\n", chainGuardIn, vx)
	ports := slices.Clone(cp.Ports)
	slices.Sort(ports)
	ports = slices.Compact(ports)
	for chunk := range slices.Chunk(ports, 15) { // multiport's limit
		fmt.Fprintf(&b, "-A %s -p tcp -m multiport --dports %s -j REJECT --reject-with tcp-reset\n", chainGuardIn, joinPorts(chunk))
	}
	// Container to container: the receiving host's guard judges what
	// reaches it. Beyond the overlay, this host is the last that knows the
	// packet came from a container (it masquerades it).
	fmt.Fprintf(&b, "-A %s -d %s -j RETURN\n", chainGuardFwd, cidr)
	fmt.Fprintf(&b, "-A %s -p udp --dport %d -j DROP\n", chainGuardFwd, vx)
	for _, e := range controlEndpoints(cp, hosts) {
		fmt.Fprintf(&b, "-A %s -d %s/32 -p tcp --dport %d -j REJECT --reject-with tcp-reset\n", chainGuardFwd, e.Addr(), e.Port())
	}
	for _, h := range hosts {
		if h.UnderlayIP.Is4() && h.UnderlayIP != o.cfg.Host.UnderlayIP {
			// A host speaks for its own containers only: an inner IPv4
			// source in the cluster outside its subnet is dropped.
			if h.Subnet.Addr().Is4() {
				fmt.Fprintf(&b, "-A %s -s %s/32 -m u32 --u32 %q -m u32 ! --u32 %q -m comment --comment \"skiff: inner source of another host\" -j DROP\n",
					chainVXLAN, h.UnderlayIP, innerSourceIn(o.cfg.Cluster.CIDR), innerSourceIn(h.Subnet))
			}
			fmt.Fprintf(&b, "-A %s -s %s/32 -j RETURN\n", chainVXLAN, h.UnderlayIP)
		}
	}
	fmt.Fprintf(&b, "-A %s -m comment --comment \"skiff: VXLAN only from cluster hosts\" -j DROP\n", chainVXLAN)
	b.WriteString("COMMIT\n")
	return b.String()
}

// innerSourceIn is the u32 match (xt_u32) for a VXLAN packet that carries
// an IPv4 frame whose source is in p. Offsets from the UDP header (the
// outer IP header's length, read from its first byte): the inner Ethernet
// type at 8 (UDP) + 8 (VXLAN) + 12, the inner source at 8 + 8 + 14 + 12.
// A packet too short for either read does not match.
func innerSourceIn(p netip.Prefix) string {
	p = p.Masked()
	a := p.Addr().As4()
	mask := ^uint32(0) << (32 - p.Bits()) // a shift by 32 gives 0
	return fmt.Sprintf("0>>22&0x3C@28>>16=0x0800&&0>>22&0x3C@42&0x%08x=0x%08x", mask, binary.BigEndian.Uint32(a[:]))
}

// controlEndpoints lists the remote control-plane endpoints, sorted and
// without duplicates: cp's and every host's published ones (an unspecified
// address stands for the host's underlay address).
func controlEndpoints(cp ControlPlane, hosts []cluster.Host) []netip.AddrPort {
	out := slices.Clone(cp.Endpoints)
	for _, h := range hosts {
		for _, e := range h.Control {
			if e.Addr().IsUnspecified() {
				e = netip.AddrPortFrom(h.UnderlayIP, e.Port())
			}
			out = append(out, e)
		}
	}
	out = slices.DeleteFunc(out, func(e netip.AddrPort) bool { return !e.Addr().Is4() || e.Addr().IsLoopback() })
	slices.SortFunc(out, netip.AddrPort.Compare)
	return slices.Compact(out)
}

func joinPorts(ps []uint16) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = fmt.Sprint(p)
	}
	return strings.Join(s, ",")
}
