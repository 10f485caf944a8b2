package overlay

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"regexp"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/iptables"
	"github.com/skiffnet/skiff/policy"
)

// iptables chains skiff owns. FORWARD jumps to SKIFF-FORWARD for overlay
// traffic: established flows are accepted by conntrack, new flows are judged
// by SKIFF-POLICY, what no rule denies is accepted, what one denies goes to
// SKIFF-DENY, which rejects it. POSTROUTING masquerades traffic from
// containers to anything outside the overlay.
const (
	chainForward = "SKIFF-FORWARD"
	chainPolicy  = "SKIFF-POLICY"
	chainBcast   = "SKIFF-BCAST"
	chainDeny    = "SKIFF-DENY"
	chainNAT     = "SKIFF-POSTROUTING"
)

// denyRule rejects what the policy denies: "no route to host" at once
// rather than a hanging connect().
var denyRule = []string{"-m", "comment", "--comment", "skiff policy deny", "-j", "REJECT", "--reject-with", "icmp-admin-prohibited"}

// setupChains creates skiff's chains if missing (keeping the policy's
// rules, so a restarting agent that cannot reach the store keeps enforcing
// the last policy), fills the fixed ones and hooks them into the built-in
// chains.
func (o *Overlay) setupChains() error {
	for _, c := range []string{chainPolicy, chainDeny, chainBcast} {
		if err := iptables.NewChain("filter", c); err != nil {
			return err
		}
	}
	if err := iptables.Append("filter", chainDeny, denyRule...); err != nil {
		return err
	}
	cidr := o.cfg.Cluster.CIDR.String()
	toForward := []string{"-m", "comment", "--comment", "skiff overlay", "-j", chainForward}
	return errors.Join(
		iptables.Chain{Table: "filter", Name: chainForward,
			Rules: []string{"-m pkttype ! --pkt-type unicast -m physdev --physdev-is-bridged -j " + chainBcast,
				"-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT", "-j " + chainPolicy, "-j ACCEPT"},
			Jumps: []iptables.Jump{{From: "FORWARD", Rule: append([]string{"-d", cidr}, toForward...)},
				{From: "FORWARD", Rule: append([]string{"-s", cidr}, toForward...)}},
		}.Install(),
		iptables.Chain{Table: "nat", Name: chainNAT,
			Rules: []string{fmt.Sprintf("-s %s -d %s -j RETURN", cidr, cidr), fmt.Sprintf("-s %s ! -d 224.0.0.0/4 -j MASQUERADE", cidr)},
			Jumps: []iptables.Jump{{From: "POSTROUTING", Rule: []string{"-m", "comment", "--comment", "skiff masquerade", "-j", chainNAT}}},
		}.Install(),
	)
}

// inputRule sends packets carrying mark to chainForward: the overlay
// packets a data-plane layer delivers to the host stack pass INPUT, not
// FORWARD, and are judged like forwarded ones. A layer never marks the
// host's own packets to containers that it turns back into the host stack:
// those leave the host through OUTPUT in the overlay, where the policy does
// not judge them either. The mark is the rule's only match, so the host's
// own traffic, which INPUT sees all of, pays one comparison (an interface
// match would copy each packet's interface name).
func inputRule(mark uint32) []string { return markedTo(mark, chainForward) }

func markedTo(mark uint32, chain string) []string {
	return append(markMatch(mark), "-m", "comment", "--comment", "skiff overlay to host stack", "-j", chain)
}

func markMatch(mark uint32) []string {
	return []string{"-m", "mark", "--mark", fmt.Sprintf("%#x", mark)}
}

// markedDeny rejects denied packets carrying mark with a TCP reset (a layer
// marks TCP only). An ICMP error cannot answer them: they are addressed to
// a container, and the host stack sends no ICMP from an address that is
// not its own, so the client would wait for its connect() timeout.
func markedDeny(mark uint32) []string {
	return append(markMatch(mark), "-p", "tcp", "-m", "comment", "--comment", "skiff deny to host stack",
		"-j", "REJECT", "--reject-with", "tcp-reset")
}

// JudgeInput applies the overlay's policy to packets carrying mark that
// reach the host's INPUT chain.
func JudgeInput(mark uint32) error {
	return errors.Join(iptables.Insert("filter", chainDeny, markedDeny(mark)...), iptables.Insert("filter", "INPUT", inputRule(mark)...))
}

// UnjudgeInput removes what JudgeInput added; none is fine.
func UnjudgeInput(mark uint32) {
	iptables.Delete("filter", "INPUT", inputRule(mark)...)
	iptables.Delete("filter", chainDeny, markedDeny(mark)...)
}

// PolicyRules renders a rule set as the body of SKIFF-POLICY, in order.
func PolicyRules(set policy.Set) []string {
	var out []string
	for _, r := range set {
		out = append(out, ruleLine("-A "+chainPolicy, r, true, chainDeny))
	}
	return out
}

// ruleLine renders r after head: its matches (the destination's when
// withDst), its comment, and its target (deny: denyTo).
func ruleLine(head string, r policy.Rule, withDst bool, denyTo string) string {
	var b strings.Builder
	b.WriteString(head)
	if r.Src.IsValid() {
		fmt.Fprintf(&b, " -s %s", r.Src)
	}
	if withDst && r.Dst.IsValid() {
		fmt.Fprintf(&b, " -d %s", r.Dst)
	}
	if r.Proto != "" {
		fmt.Fprintf(&b, " -p %s", r.Proto)
	}
	if r.Port != 0 {
		fmt.Fprintf(&b, " --dport %d", r.Port)
	}
	if r.PortEnd != 0 {
		fmt.Fprintf(&b, ":%d", r.PortEnd)
	}
	fmt.Fprintf(&b, " -m comment --comment \"skiff policy %s\"", r.ID)
	if r.Action == policy.Allow {
		b.WriteString(" -j ACCEPT")
	} else {
		b.WriteString(" -j " + denyTo)
	}
	return b.String()
}

// BroadcastRules renders SKIFF-BCAST: for each local container, by the
// bridge port a copy of a broadcast or multicast packet leaves through
// (its host veth), the rules whose destination covers that container, in
// order, then acceptance. Bridged non-unicast packets between containers
// come here first: their destination address (a broadcast or a group) is
// no container's, and would match no destination a rule names.
func BroadcastRules(set policy.Set, local []cluster.Endpoint) []string {
	var out []string
	for _, e := range local {
		port := fmt.Sprintf("-A %s -m physdev --physdev-out %s", chainBcast, e.Veth)
		for _, r := range set {
			if !r.Dst.IsValid() || r.Dst.Contains(e.IP.Addr()) {
				out = append(out, ruleLine(port, r, false, "DROP"))
			}
		}
		out = append(out, port+" -j ACCEPT")
	}
	return out
}

// SyncPolicy replaces SKIFF-POLICY with set, so new flows are judged by it,
// and — when the set changed — ends established flows it denies: their
// conntrack entries are deleted, so their next packet is a new flow that the
// chain rejects. A policy change thus takes effect on established flows too.
// SKIFF-BCAST judges broadcast and multicast between the local containers
// as if each copy were addressed to the container receiving it.
func (o *Overlay) SyncPolicy(set policy.Set, local []cluster.Endpoint) error {
	if err := o.writeChains(map[string][]string{chainPolicy: PolicyRules(set), chainBcast: BroadcastRules(set, local)}); err != nil {
		return err
	}
	if !o.PolicyChanged(set) {
		return nil
	}
	n, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, deniedFlows{set, o.cfg.Cluster.CIDR})
	if err != nil {
		return fmt.Errorf("end established flows the policy denies: %w", err)
	}
	if n > 0 {
		o.log.Info("ended established flows denied by the new policy", "flows", n)
	}
	applied := slices.Clone(set)
	o.applied = &applied
	return nil
}

// writeChains replaces each filter chain with its rules (iptables-restore
// lines) in one step, but for the chains that hold them already: writing
// a chain zeroes its counters, which count what the policy denied.
// "Already" is what this agent last wrote, while the chain has as many
// rules still (one flushed or edited since is written again).
func (o *Overlay) writeChains(chains map[string][]string) error {
	if o.written == nil {
		o.written = map[string]string{}
	}
	var b strings.Builder
	write := map[string]string{}
	for name, rules := range chains {
		text := strings.Join(rules, "\n")
		if o.written[name] == text {
			if live, err := iptables.Counters("filter", name); err == nil && len(live) == len(rules) {
				continue
			}
		}
		write[name] = text
		b.WriteString(":" + name + " - [0:0]\n")
		for _, r := range rules {
			b.WriteString(r + "\n")
		}
	}
	if len(write) == 0 {
		return nil
	}
	if err := iptables.Restore("*filter\n" + b.String() + "COMMIT\n"); err != nil {
		return err
	}
	maps.Copy(o.written, write)
	return nil
}

// PolicyDenies counts, by rule, the packets this host's policy chains
// denied — new flows in SKIFF-POLICY (every layer sends the flows it does
// not judge allowed there), broadcast and multicast copies in SKIFF-BCAST —
// since the agent started or the rules last changed.
func PolicyDenies() (map[string]uint64, error) {
	out := map[string]uint64{}
	for _, c := range []struct{ chain, target string }{{chainPolicy, chainDeny}, {chainBcast, "DROP"}} {
		rules, err := iptables.Counters("filter", c.chain)
		if err != nil {
			return nil, err
		}
		for _, r := range rules {
			if m := deniedBy.FindStringSubmatch(r.Rule); m != nil && strings.HasSuffix(r.Rule, " -j "+c.target) {
				out[m[1]] += r.Packets
			}
		}
	}
	return out, nil
}

// deniedBy finds a policy rule's id in its comment (ruleLine).
var deniedBy = regexp.MustCompile(`--comment "skiff policy ([^"]+)"`)

// PolicyChanged reports whether set differs from the rule set last enforced.
func (o *Overlay) PolicyChanged(set policy.Set) bool {
	return o.applied == nil || !slices.Equal(*o.applied, set)
}

// deniedFlows matches conntrack entries of overlay flows that set denies.
type deniedFlows struct {
	set  policy.Set
	cidr netip.Prefix
}

var protoNames = map[uint8]string{unix.IPPROTO_TCP: policy.TCP, unix.IPPROTO_UDP: policy.UDP, unix.IPPROTO_ICMP: policy.ICMP}

// MatchConntrackFlow judges a flow as the policy chain judged its first
// packet: from its source to where it went after any DNAT (a Service's
// backend, a published port's container), which is the reply's source.
func (d deniedFlows) MatchConntrackFlow(f *netlink.ConntrackFlow) bool {
	src, _ := netip.AddrFromSlice(f.Forward.SrcIP.To4())
	dst, _ := netip.AddrFromSlice(f.Reverse.SrcIP.To4())
	if !d.cidr.Contains(src) && !d.cidr.Contains(dst) {
		return false
	}
	flow := policy.Flow{Src: src, Dst: dst, Proto: protoNames[f.Forward.Protocol]}
	if flow.Proto == policy.TCP || flow.Proto == policy.UDP {
		flow.Port = f.Reverse.SrcPort
	}
	return !d.set.Allowed(flow)
}
