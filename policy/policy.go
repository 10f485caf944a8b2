// Package policy is skiff's network policy model: ordered allow/deny rules on
// overlay prefixes, protocol and destination port. Every data-plane layer asks
// the same question of it — is this flow allowed? — so the model lives here
// and nowhere else. Rendering a rule set into a layer's own form (iptables,
// eBPF maps) is that layer's business.
package policy

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Action is what a matching rule does with a new flow.
type Action string

const (
	Allow Action = "allow"
	Deny  Action = "deny"
)

// Protocols a rule can name. The empty string matches every protocol.
const (
	TCP  = "tcp"
	UDP  = "udp"
	ICMP = "icmp"
)

// Rule is one ordered policy rule. Zero-valued match fields match anything.
type Rule struct {
	ID       string       `json:"id"`
	Priority int          `json:"priority"` // lower first; ties broken by ID
	Action   Action       `json:"action"`
	Src      netip.Prefix `json:"src,omitzero"`
	Dst      netip.Prefix `json:"dst,omitzero"`
	Proto    string       `json:"proto,omitempty"`
	Port     uint16       `json:"port,omitempty"`     // destination port, tcp/udp only
	PortEnd  uint16       `json:"port_end,omitempty"` // last port of the range Port..PortEnd; 0: Port alone
}

// Flow is the part of a new flow that rules match on.
type Flow struct {
	Src, Dst netip.Addr
	Proto    string
	Port     uint16
}

var idPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

// Validate reports the first thing wrong with r, in words a user can act on.
func (r Rule) Validate() error {
	if !idPattern.MatchString(r.ID) {
		return fmt.Errorf("rule id %q: use 1-63 lower-case letters, digits, '.', '_' or '-'", r.ID)
	}
	if r.Action != Allow && r.Action != Deny {
		return fmt.Errorf("rule %s: action %q is neither %q nor %q", r.ID, r.Action, Allow, Deny)
	}
	for _, p := range []netip.Prefix{r.Src, r.Dst} {
		if p.IsValid() && !p.Addr().Is4() {
			return fmt.Errorf("rule %s: %s is not an IPv4 prefix", r.ID, p)
		}
		if p.IsValid() && p != p.Masked() {
			return fmt.Errorf("rule %s: %s has host bits set (did you mean %s?)", r.ID, p, p.Masked())
		}
	}
	switch r.Proto {
	case "", TCP, UDP, ICMP:
	default:
		return fmt.Errorf("rule %s: protocol %q is not tcp, udp or icmp", r.ID, r.Proto)
	}
	if r.Port != 0 && r.Proto != TCP && r.Proto != UDP {
		return fmt.Errorf("rule %s: a port needs protocol tcp or udp", r.ID)
	}
	if r.PortEnd != 0 && r.PortEnd <= r.Port {
		return fmt.Errorf("rule %s: port range %d-%d: the last port must follow the first", r.ID, r.Port, r.PortEnd)
	}
	return nil
}

// LastPort is the last destination port r matches: PortEnd for a range,
// else Port (0: any port).
func (r Rule) LastPort() uint16 {
	return max(r.Port, r.PortEnd)
}

// MatchesPort reports whether r's destination ports include port.
func (r Rule) MatchesPort(port uint16) bool {
	return r.Port == 0 || port >= r.Port && port <= r.LastPort()
}

// Matches reports whether r applies to f.
func (r Rule) Matches(f Flow) bool {
	if r.Src.IsValid() && !r.Src.Contains(f.Src) {
		return false
	}
	if r.Dst.IsValid() && !r.Dst.Contains(f.Dst) {
		return false
	}
	if r.Proto != "" && r.Proto != f.Proto {
		return false
	}
	return r.MatchesPort(f.Port)
}

// String renders r in the CLI's own syntax, so `skiff policy list` output can
// be pasted back into `skiff policy add`.
func (r Rule) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s priority %d", r.ID, r.Action, r.Priority)
	if r.Src.IsValid() {
		fmt.Fprintf(&b, " from %s", r.Src)
	}
	if r.Dst.IsValid() {
		fmt.Fprintf(&b, " to %s", r.Dst)
	}
	if r.Proto != "" {
		fmt.Fprintf(&b, " proto %s", r.Proto)
	}
	if r.Port != 0 {
		fmt.Fprintf(&b, " port %d", r.Port)
	}
	if r.PortEnd != 0 {
		fmt.Fprintf(&b, "-%d", r.PortEnd)
	}
	return b.String()
}

// Set is a rule set in evaluation order.
type Set []Rule

// NewSet validates rules and orders them by priority, then ID.
func NewSet(rules []Rule) (Set, error) {
	s := slices.Clone(rules)
	var errs []error
	for _, r := range s {
		errs = append(errs, r.Validate())
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	slices.SortFunc(s, func(a, b Rule) int {
		return cmp.Or(cmp.Compare(a.Priority, b.Priority), cmp.Compare(a.ID, b.ID))
	})
	return s, nil
}

// Allowed evaluates f against the set: the first matching rule decides, and a
// flow no rule matches is allowed (default allow).
func (s Set) Allowed(f Flow) bool {
	for _, r := range s {
		if r.Matches(f) {
			return r.Action == Allow
		}
	}
	return true
}

// ParseRule reads the CLI syntax:
//
//	ID allow|deny [priority N] [from PREFIX] [to PREFIX] [proto tcp|udp|icmp] [port N[-M]]
//
// A bare address is taken as a /32; port N-M is a range, both ends included.
func ParseRule(args []string) (Rule, error) {
	if len(args) < 2 {
		return Rule{}, errors.New("usage: ID allow|deny [priority N] [from PREFIX] [to PREFIX] [proto tcp|udp|icmp] [port N[-M]]")
	}
	r := Rule{ID: args[0], Action: Action(args[1]), Priority: 1000}
	rest := args[2:]
	if len(rest)%2 != 0 {
		return Rule{}, fmt.Errorf("%q needs a value", rest[len(rest)-1])
	}
	for i := 0; i < len(rest); i += 2 {
		key, val := rest[i], rest[i+1]
		var err error
		switch key {
		case "priority":
			r.Priority, err = strconv.Atoi(val)
		case "from":
			r.Src, err = parsePrefix(val)
		case "to":
			r.Dst, err = parsePrefix(val)
		case "proto":
			r.Proto = val
		case "port":
			first, last, isRange := strings.Cut(val, "-")
			if r.Port, err = parsePort(first); err == nil && isRange {
				r.PortEnd, err = parsePort(last)
			}
		default:
			err = errors.New("unknown keyword (want priority, from, to, proto or port)")
		}
		if err != nil {
			return Rule{}, fmt.Errorf("%s %s: %w", key, val, err)
		}
	}
	return r, r.Validate()
}

func parsePort(s string) (uint16, error) {
	p, err := strconv.ParseUint(s, 10, 16)
	if err == nil && p == 0 {
		err = errors.New("port 0")
	}
	return uint16(p), err
}

func parsePrefix(s string) (netip.Prefix, error) {
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, err
		}
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	return netip.ParsePrefix(s)
}
