package overlay

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

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
	chainDeny    = "SKIFF-DENY"
	chainNAT     = "SKIFF-POSTROUTING"
)

func iptables(args ...string) error {
	out, err := exec.Command("iptables", append([]string{"-w", "5"}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("iptables %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// ensureRule puts rule first in chain unless it is there.
func ensureRule(table, chain string, rule ...string) error {
	return ensure(table, chain, rule, "-I", chain, "1")
}

// ensureLast appends rule to chain unless it is there.
func ensureLast(table, chain string, rule ...string) error {
	return ensure(table, chain, rule, "-A", chain)
}

// ensure adds rule to chain with the add command unless it is there.
func ensure(table, chain string, rule []string, add ...string) error {
	if iptables(append([]string{"-t", table, "-C", chain}, rule...)...) == nil {
		return nil
	}
	return iptables(slices.Concat([]string{"-t", table}, add, rule)...)
}

// denyRule rejects what the policy denies: "no route to host" at once
// rather than a hanging connect().
var denyRule = []string{"-m", "comment", "--comment", "skiff policy deny", "-j", "REJECT", "--reject-with", "icmp-admin-prohibited"}

// setupChains creates skiff's chains if missing (keeping their rules, so a
// restarting agent that cannot reach the store keeps enforcing the last
// policy), fills the fixed ones and hooks them into the built-in chains.
func (o *Overlay) setupChains() error {
	for _, c := range [][2]string{{"filter", chainForward}, {"filter", chainPolicy}, {"filter", chainDeny}, {"nat", chainNAT}} {
		if iptables("-t", c[0], "-n", "-L", c[1]) != nil {
			if err := iptables("-t", c[0], "-N", c[1]); err != nil {
				return err
			}
		}
	}
	cidr := o.cfg.Cluster.CIDR.String()
	var b strings.Builder
	b.WriteString("*filter\n:" + chainForward + " - [0:0]\n")
	fmt.Fprintf(&b, "-A %s -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n", chainForward)
	fmt.Fprintf(&b, "-A %s -j %s\n", chainForward, chainPolicy)
	fmt.Fprintf(&b, "-A %s -j ACCEPT\nCOMMIT\n", chainForward)
	b.WriteString("*nat\n:" + chainNAT + " - [0:0]\n")
	fmt.Fprintf(&b, "-A %s -s %s -d %s -j RETURN\n", chainNAT, cidr, cidr)
	fmt.Fprintf(&b, "-A %s -s %s ! -d 224.0.0.0/4 -j MASQUERADE\nCOMMIT\n", chainNAT, cidr)
	if err := restore(b.String()); err != nil {
		return err
	}
	return errors.Join(
		ensureLast("filter", chainDeny, denyRule...),
		ensureRule("filter", "FORWARD", "-d", cidr, "-m", "comment", "--comment", "skiff overlay", "-j", chainForward),
		ensureRule("filter", "FORWARD", "-s", cidr, "-m", "comment", "--comment", "skiff overlay", "-j", chainForward),
		ensureRule("nat", "POSTROUTING", "-m", "comment", "--comment", "skiff masquerade", "-j", chainNAT),
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
	return errors.Join(ensureRule("filter", chainDeny, markedDeny(mark)...), ensureRule("filter", "INPUT", inputRule(mark)...))
}

// UnjudgeInput removes what JudgeInput added; none is fine.
func UnjudgeInput(mark uint32) {
	removeRules("INPUT", inputRule(mark))
	removeRules(chainDeny, markedDeny(mark))
}

// removeRules deletes every copy of rule from the filter table's chain.
func removeRules(chain string, rule []string) {
	for iptables(append([]string{"-t", "filter", "-D", chain}, rule...)...) == nil {
	}
}

// restore applies rules with iptables-restore --noflush: every chain declared
// in rules is replaced atomically, nothing else is touched.
func restore(rules string) error {
	cmd := exec.Command("iptables-restore", "-w", "5", "--noflush")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("iptables-restore: %w: %s\ninput:\n%s", err, bytes.TrimSpace(out), rules)
	}
	return nil
}

// PolicyRules renders a rule set as the body of SKIFF-POLICY, in order.
func PolicyRules(set policy.Set) []string {
	var out []string
	for _, r := range set {
		var b strings.Builder
		fmt.Fprintf(&b, "-A %s", chainPolicy)
		if r.Src.IsValid() {
			fmt.Fprintf(&b, " -s %s", r.Src)
		}
		if r.Dst.IsValid() {
			fmt.Fprintf(&b, " -d %s", r.Dst)
		}
		if r.Proto != "" {
			fmt.Fprintf(&b, " -p %s", r.Proto)
		}
		if r.Port != 0 {
			fmt.Fprintf(&b, " --dport %d", r.Port)
		}
		fmt.Fprintf(&b, " -m comment --comment \"skiff policy %s\"", r.ID)
		if r.Action == policy.Allow {
			b.WriteString(" -j ACCEPT")
		} else {
			b.WriteString(" -j " + chainDeny)
		}
		out = append(out, b.String())
	}
	return out
}

// SyncPolicy replaces SKIFF-POLICY with set, so new flows are judged by it,
// and — when the set changed — ends established flows it denies: their
// conntrack entries are deleted, so their next packet is a new flow that the
// chain rejects. A policy change thus takes effect on established flows too.
func (o *Overlay) SyncPolicy(set policy.Set) error {
	rules := "*filter\n:" + chainPolicy + " - [0:0]\n"
	for _, r := range PolicyRules(set) {
		rules += r + "\n"
	}
	if err := restore(rules + "COMMIT\n"); err != nil {
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

func (d deniedFlows) MatchConntrackFlow(f *netlink.ConntrackFlow) bool {
	src, _ := netip.AddrFromSlice(f.Forward.SrcIP.To4())
	dst, _ := netip.AddrFromSlice(f.Forward.DstIP.To4())
	if !d.cidr.Contains(src) && !d.cidr.Contains(dst) {
		return false
	}
	flow := policy.Flow{Src: src, Dst: dst, Proto: protoNames[f.Forward.Protocol]}
	if flow.Proto == policy.TCP || flow.Proto == policy.UDP {
		flow.Port = f.Forward.DstPort
	}
	return !d.set.Allowed(flow)
}
