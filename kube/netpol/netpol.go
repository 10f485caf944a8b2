// Package netpol translates Kubernetes NetworkPolicy (networking.k8s.io/v1)
// into skiff's ordered rules (package policy), so that every layer enforces
// it on its fast paths the way it enforces skiff's own rules.
//
// skiff's rule set is one first-match function of (source, destination,
// protocol, destination port), evaluated alike on every host a flow touches.
// NetworkPolicy allows a flow when both ends allow it: the source's egress
// policies (if any select it) and the destination's ingress policies (if any
// select it). Translate emits that conjunction as three bands of rules, each
// closing a pod's allows with a deny for that pod:
//
//  1. pairs: for a destination P and an egress-isolated source S that P's
//     ingress peers name, where S's egress does not allow everything P's
//     ingress allows S: allow S→P for the services both allow, deny S→P;
//  2. ingress: for each ingress-isolated pod P: allow peer→P per entry,
//     deny →P;
//  3. egress: for each egress-isolated pod S: allow S→peer per entry,
//     deny S→.
//
// Anything else is allowed (skiff's default). Replies pass as replies
// (conntrack, the cache's connection table, connect-time judging). See
// docs/kubernetes.md for what is supported.
package netpol

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/skiffnet/skiff/policy"
)

// FirstPriority is the priority of the first translated band: the rules
// come after any lower-numbered rule of the cluster's own.
const FirstPriority = 100000

// Pod is what translation needs of a pod: where it is, what selects it,
// and its named ports.
type Pod struct {
	Namespace, Name string
	IP              netip.Addr
	Labels          map[string]string
	Ports           []corev1.ContainerPort
}

// PodOf is a pod's part in translation; false for pods NetworkPolicy does
// not apply to: on the host's network, finished, or without an IPv4 pod
// address yet (ip, when valid, stands for the address: a pod whose address
// the API does not show yet, but this host gave it).
func PodOf(p *corev1.Pod, ip netip.Addr) (Pod, bool) {
	if p.Spec.HostNetwork || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
		return Pod{}, false
	}
	if !ip.IsValid() {
		ip, _ = netip.ParseAddr(p.Status.PodIP)
	}
	if !ip.Is4() {
		return Pod{}, false
	}
	out := Pod{Namespace: p.Namespace, Name: p.Name, IP: ip, Labels: p.Labels}
	for _, c := range p.Spec.Containers {
		out.Ports = append(out.Ports, c.Ports...)
	}
	return out, true
}

// Translate renders policies for pods into skiff's rules. namespaces maps
// each namespace's name to its labels. A policy with a selector it cannot
// read is reported and left out: it selects and allows nothing.
func Translate(policies []*networkingv1.NetworkPolicy, pods []Pod, namespaces map[string]map[string]string) (policy.Set, error) {
	t := translation{pods: pods, namespaces: namespaces, ingress: map[int][]entry{}, egress: map[int][]entry{}}
	var errs []error
	for _, np := range policies {
		if err := t.add(np); err != nil {
			errs = append(errs, fmt.Errorf("network policy %s/%s: %w", np.Namespace, np.Name, err))
		}
	}
	rules := t.rules()
	set, err := policy.NewSet(rules)
	if err != nil {
		return nil, fmt.Errorf("translated rules: %w", err) // a bug: Translate makes only valid rules
	}
	return set, errors.Join(errs...)
}

// entry allows a service set to (egress) or from (ingress) one peer
// prefix.
type entry struct {
	peer netip.Prefix
	svc  services
}

type translation struct {
	pods       []Pod
	namespaces map[string]map[string]string
	// Isolated pods (index in pods) and their allow entries.
	ingress, egress map[int][]entry
}

// add takes one policy's isolation and entries.
func (t *translation) add(np *networkingv1.NetworkPolicy) error {
	sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
	if err != nil {
		return fmt.Errorf("podSelector: %w", err)
	}
	ingress, egress := false, len(np.Spec.Egress) > 0
	if len(np.Spec.PolicyTypes) == 0 {
		ingress = true
	} else {
		egress = false
		for _, pt := range np.Spec.PolicyTypes {
			ingress = ingress || pt == networkingv1.PolicyTypeIngress
			egress = egress || pt == networkingv1.PolicyTypeEgress
		}
	}
	// Peers resolve the same for every selected pod: resolve them once.
	// A peer that cannot be read allows nothing (fail closed).
	var errs []error
	type rule struct {
		peers []peer
		ports []networkingv1.NetworkPolicyPort
	}
	var in, out []rule
	if ingress {
		for _, r := range np.Spec.Ingress {
			ps, err := t.peers(np.Namespace, r.From)
			errs = append(errs, err)
			in = append(in, rule{ps, r.Ports})
		}
	}
	if egress {
		for _, r := range np.Spec.Egress {
			ps, err := t.peers(np.Namespace, r.To)
			errs = append(errs, err)
			out = append(out, rule{ps, r.Ports})
		}
	}
	for i, p := range t.pods {
		if p.Namespace != np.Namespace || !sel.Matches(labels.Set(p.Labels)) {
			continue
		}
		if ingress {
			isolate(t.ingress, i)
			for _, r := range in {
				svc := servicesOn(r.ports, &p) // named ports: the isolated pod's own
				for _, pe := range r.peers {
					t.ingress[i] = append(t.ingress[i], entry{pe.prefix, svc})
				}
			}
		}
		if egress {
			isolate(t.egress, i)
			for _, r := range out {
				for _, pe := range r.peers {
					svc := servicesOn(r.ports, pe.pod) // named ports: the peer pod's; none for an ipBlock
					t.egress[i] = append(t.egress[i], entry{pe.prefix, svc})
				}
				// A named port to an address block (every address, an
				// ipBlock) is the port of that name of each pod in it.
				named := namedPorts(r.ports)
				for j := range t.pods {
					if len(named) > 0 && slices.ContainsFunc(r.peers, func(pe peer) bool { return pe.pod == nil && pe.prefix.Contains(t.pods[j].IP) }) {
						t.egress[i] = append(t.egress[i], entry{netip.PrefixFrom(t.pods[j].IP, 32), servicesOn(named, &t.pods[j])})
					}
				}
			}
		}
	}
	return errors.Join(errs...)
}

// peer is one prefix a rule names: a pod's address (pod set) or a part of
// an ipBlock.
type peer struct {
	prefix netip.Prefix
	pod    *Pod
}

// peers resolves a rule's peers; none listed is every source or
// destination.
func (t *translation) peers(namespace string, from []networkingv1.NetworkPolicyPeer) ([]peer, error) {
	if len(from) == 0 {
		return []peer{{prefix: netip.PrefixFrom(netip.IPv4Unspecified(), 0)}}, nil
	}
	var out []peer
	var errs []error
	for _, f := range from {
		if f.IPBlock != nil {
			ps, err := ipBlock(f.IPBlock)
			errs = append(errs, err)
			for _, p := range ps {
				out = append(out, peer{prefix: p})
			}
			continue
		}
		podSel, nsSel := labels.Everything(), labels.Selector(nil)
		var err error
		if f.PodSelector != nil {
			if podSel, err = metav1.LabelSelectorAsSelector(f.PodSelector); err != nil {
				errs = append(errs, fmt.Errorf("peer podSelector: %w", err))
				continue
			}
		}
		if f.NamespaceSelector != nil {
			if nsSel, err = metav1.LabelSelectorAsSelector(f.NamespaceSelector); err != nil {
				errs = append(errs, fmt.Errorf("peer namespaceSelector: %w", err))
				continue
			}
		}
		for i := range t.pods {
			p := &t.pods[i]
			inNamespace := p.Namespace == namespace
			if nsSel != nil {
				inNamespace = nsSel.Matches(labels.Set(t.namespaceLabels(p.Namespace)))
			}
			if inNamespace && podSel.Matches(labels.Set(p.Labels)) {
				out = append(out, peer{prefix: netip.PrefixFrom(p.IP, 32), pod: p})
			}
		}
	}
	return out, errors.Join(errs...)
}

// namespaceLabels are a namespace's labels, with the name label the API
// server sets on every namespace.
func (t *translation) namespaceLabels(name string) map[string]string {
	l := map[string]string{"kubernetes.io/metadata.name": name}
	for k, v := range t.namespaces[name] {
		l[k] = v
	}
	return l
}

// ipBlock is a block's CIDR less its exceptions, as disjoint prefixes. An
// IPv6 block names no address of skiff's overlay: none.
func ipBlock(b *networkingv1.IPBlock) ([]netip.Prefix, error) {
	cidr, err := netip.ParsePrefix(b.CIDR)
	if err != nil {
		return nil, fmt.Errorf("ipBlock %q: %w", b.CIDR, err)
	}
	if !cidr.Addr().Is4() {
		return nil, nil
	}
	out := []netip.Prefix{cidr.Masked()}
	for _, e := range b.Except {
		x, err := netip.ParsePrefix(e)
		if err != nil {
			return nil, fmt.Errorf("ipBlock except %q: %w", e, err)
		}
		if !x.Addr().Is4() {
			continue
		}
		var next []netip.Prefix
		for _, p := range out {
			next = append(next, subtract(p, x.Masked())...)
		}
		out = next
	}
	return out, nil
}

// subtract is p less x, as disjoint prefixes.
func subtract(p, x netip.Prefix) []netip.Prefix {
	switch {
	case !p.Overlaps(x):
		return []netip.Prefix{p}
	case x.Bits() <= p.Bits(): // x covers p
		return nil
	}
	// Split p in halves; the one without x stays whole.
	lo := netip.PrefixFrom(p.Addr(), p.Bits()+1)
	a := p.Addr().As4()
	bit := p.Bits()
	a[bit/8] |= 0x80 >> (bit % 8)
	hi := netip.PrefixFrom(netip.AddrFrom4(a), p.Bits()+1)
	return append(subtract(lo, x), subtract(hi, x)...)
}

// namedPorts are the ports given by name.
func namedPorts(ports []networkingv1.NetworkPolicyPort) []networkingv1.NetworkPolicyPort {
	var out []networkingv1.NetworkPolicyPort
	for _, p := range ports {
		if p.Port != nil && p.Port.Type == intstr.String {
			out = append(out, p)
		}
	}
	return out
}

// servicesOn is what a rule's ports allow on the destination pod dst (nil:
// an ipBlock, where a named port names nothing). No ports: everything.
func servicesOn(ports []networkingv1.NetworkPolicyPort, dst *Pod) services {
	if len(ports) == 0 {
		return services{all: true}
	}
	var s services
	for _, p := range ports {
		proto := corev1.ProtocolTCP
		if p.Protocol != nil {
			proto = *p.Protocol
		}
		if proto != corev1.ProtocolTCP && proto != corev1.ProtocolUDP {
			continue // SCTP: skiff carries none, and allows none
		}
		switch {
		case p.Port == nil:
			s.add(proto, span{1, 65535})
		case p.Port.Type == intstr.String:
			if dst == nil {
				continue
			}
			for _, cp := range dst.Ports {
				if cp.Name == p.Port.StrVal && cmp.Or(cp.Protocol, corev1.ProtocolTCP) == proto && cp.ContainerPort > 0 && cp.ContainerPort < 65536 {
					s.add(proto, span{uint16(cp.ContainerPort), uint16(cp.ContainerPort)})
				}
			}
		case p.Port.IntVal > 0 && p.Port.IntVal < 65536:
			end := p.Port.IntVal
			if p.EndPort != nil && *p.EndPort > end && *p.EndPort < 65536 {
				end = *p.EndPort
			}
			s.add(proto, span{uint16(p.Port.IntVal), uint16(end)})
		}
	}
	return s
}

// rules emits the three bands.
func (t *translation) rules() []policy.Rule {
	var out []policy.Rule
	emit := func(band int, action policy.Action, src, dst netip.Prefix, svc services) {
		for _, r := range svc.rules() {
			r.Action, r.Src, r.Dst = action, side(src), side(dst)
			r.Priority = FirstPriority + 2*(band-1)
			if action == policy.Deny {
				r.Priority++
			}
			r.ID = ruleID(band, r)
			out = append(out, r)
		}
	}
	everything := services{all: true}
	host := func(i int) netip.Prefix { return netip.PrefixFrom(t.pods[i].IP, 32) }
	for _, p := range sortedKeys(t.ingress) {
		// Band 1: egress-isolated sources P's ingress names.
		for _, s := range sortedKeys(t.egress) {
			if s == p {
				continue // a pod's own address stays in its namespace
			}
			in := allowed(t.ingress[p], t.pods[s].IP)
			if in.empty() {
				continue // band 2 denies
			}
			eg := allowed(t.egress[s], t.pods[p].IP)
			if eg.covers(in) {
				continue // band 2's allows are the conjunction
			}
			emit(1, policy.Allow, host(s), host(p), eg.intersect(in))
			emit(1, policy.Deny, host(s), host(p), everything)
		}
		// Band 2: P's ingress.
		for _, e := range merged(t.ingress[p]) {
			emit(2, policy.Allow, e.peer, host(p), e.svc)
		}
		emit(2, policy.Deny, netip.Prefix{}, host(p), everything)
	}
	// Band 3: egress.
	for _, s := range sortedKeys(t.egress) {
		for _, e := range merged(t.egress[s]) {
			emit(3, policy.Allow, host(s), e.peer, e.svc)
		}
		emit(3, policy.Deny, host(s), netip.Prefix{}, everything)
	}
	// Equal rules (one pod on two routes to one answer) once.
	slices.SortFunc(out, func(a, b policy.Rule) int { return cmp.Compare(a.ID, b.ID) })
	return slices.CompactFunc(out, func(a, b policy.Rule) bool { return a.ID == b.ID })
}

// side is a prefix as a rule names it: /0 is no restriction.
func side(p netip.Prefix) netip.Prefix {
	if p.Bits() == 0 {
		return netip.Prefix{}
	}
	return p
}

// allowed is the union of the entries' services whose peer holds a.
func allowed(entries []entry, a netip.Addr) services {
	var s services
	for _, e := range entries {
		if e.peer.Contains(a) {
			s = s.union(e.svc)
		}
	}
	return s
}

// merged folds entries with one peer into one.
func merged(entries []entry) []entry {
	by := map[netip.Prefix]services{}
	var order []netip.Prefix
	for _, e := range entries {
		if _, ok := by[e.peer]; !ok {
			order = append(order, e.peer)
		}
		by[e.peer] = by[e.peer].union(e.svc)
	}
	out := make([]entry, 0, len(order))
	for _, p := range order {
		if !by[p].empty() {
			out = append(out, entry{p, by[p]})
		}
	}
	return out
}

// isolate marks pod i isolated, with or without entries.
func isolate(m map[int][]entry, i int) {
	if _, ok := m[i]; !ok {
		m[i] = []entry{}
	}
}

func sortedKeys(m map[int][]entry) []int {
	keys := make([]int, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// ruleID names a rule by its band, action and match: stable across
// translations and hosts, so that every agent renders the same set.
func ruleID(band int, r policy.Rule) string {
	h := sha256.Sum256(fmt.Appendf(nil, "%d|%s|%s|%s|%s|%d|%d", band, r.Action, r.Src, r.Dst, r.Proto, r.Port, r.PortEnd))
	return fmt.Sprintf("k8s-%d%c-%s", band, r.Action[0], hex.EncodeToString(h[:6]))
}
