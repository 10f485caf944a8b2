package netpol

import (
	"cmp"
	"slices"

	corev1 "k8s.io/api/core/v1"

	"github.com/skiffnet/skiff/policy"
)

// span is the destination ports lo..hi (1..65535: any port).
type span struct{ lo, hi uint16 }

// services is a set of (protocol, destination port): everything, or port
// spans of TCP and UDP (NetworkPolicy names no other protocol but SCTP,
// which skiff does not carry).
type services struct {
	all      bool
	tcp, udp []span // sorted, disjoint, not adjacent
}

func (s services) empty() bool { return !s.all && len(s.tcp) == 0 && len(s.udp) == 0 }

func (s *services) add(proto corev1.Protocol, sp span) {
	if proto == corev1.ProtocolUDP {
		s.udp = normal(append(s.udp, sp))
	} else {
		s.tcp = normal(append(s.tcp, sp))
	}
}

func (s services) union(o services) services {
	if s.all || o.all {
		return services{all: true}
	}
	return services{tcp: normal(append(slices.Clone(s.tcp), o.tcp...)), udp: normal(append(slices.Clone(s.udp), o.udp...))}
}

func (s services) intersect(o services) services {
	switch {
	case s.all:
		return o
	case o.all:
		return s
	}
	return services{tcp: intersect(s.tcp, o.tcp), udp: intersect(s.udp, o.udp)}
}

// covers reports whether s holds every service of o.
func (s services) covers(o services) bool {
	switch {
	case s.all:
		return true
	case o.all:
		return false
	}
	return slices.Equal(intersect(s.tcp, o.tcp), o.tcp) && slices.Equal(intersect(s.udp, o.udp), o.udp)
}

// rules are s as rule matches (protocol and ports; the caller sets the
// rest).
func (s services) rules() []policy.Rule {
	if s.all {
		return []policy.Rule{{}}
	}
	var out []policy.Rule
	for _, p := range []struct {
		proto string
		spans []span
	}{{policy.TCP, s.tcp}, {policy.UDP, s.udp}} {
		for _, sp := range p.spans {
			r := policy.Rule{Proto: p.proto}
			if sp != (span{1, 65535}) {
				r.Port = sp.lo
				if sp.hi > sp.lo {
					r.PortEnd = sp.hi
				}
			}
			out = append(out, r)
		}
	}
	return out
}

// normal sorts spans and joins those that overlap or touch.
func normal(spans []span) []span {
	slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.lo, b.lo) })
	var out []span
	for _, sp := range spans {
		if n := len(out); n > 0 && uint32(sp.lo) <= uint32(out[n-1].hi)+1 {
			out[n-1].hi = max(out[n-1].hi, sp.hi)
			continue
		}
		out = append(out, sp)
	}
	return out
}

// intersect is the ports both normal span lists hold.
func intersect(a, b []span) []span {
	var out []span
	for _, x := range a {
		for _, y := range b {
			if lo, hi := max(x.lo, y.lo), min(x.hi, y.hi); lo <= hi {
				out = append(out, span{lo, hi})
			}
		}
	}
	return normal(out)
}
