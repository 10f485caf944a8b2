// Package policymap compiles skiff's policy (package policy) into the maps
// policymap.h reads, so that an eBPF program judges a flow's first packet
// with the verdict the overlay's SKIFF-POLICY chain gives, at a cost that
// does not grow with the number of rules (docs/cache.md, "Policy in eBPF").
package policymap

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/skiffnet/skiff/policy"
)

// Verdicts of policymap.h.
const (
	Unknown = 0 // not compiled: the overlay judges
	Allow   = 1
	Deny    = 2
)

// Direction is the side of a flow the local container is on.
type Direction int

const (
	Egress  Direction = iota // the container sends (it is the source)
	Ingress                  // the container receives (it is the destination)
)

// Protocol numbers the rules name.
var protocols = map[string]uint8{policy.TCP: 6, policy.UDP: 17, policy.ICMP: 1}

// LPMKey is an entry of skp_egress or skp_ingress: the local container's
// address and a prefix of the other end's.
type LPMKey struct {
	Local netip.Addr
	Other netip.Prefix
}

// VKey is an entry of skp_verdicts: a node's verdict for a protocol (0: any
// the node's rules do not name) and a destination port (0: any they do not
// name).
type VKey struct {
	Node  uint32
	Proto uint8
	Port  uint16
}

// Entries are the maps' contents for a rule set and a host's containers.
type Entries struct {
	Egress, Ingress map[LPMKey]uint32
	Verdicts        map[VKey]uint8
}

// key of one (protocol, port) cell of a node's table.
type cell struct {
	proto uint8
	port  uint16
}

// Compile cuts set for each local container in both directions. Nodes with
// the same verdict table share an id, from ids (table → id; updated in
// place, so that a later compile keeps the ids of tables that stay and
// an update never shows a program a node without its verdicts).
func Compile(set policy.Set, local []netip.Addr, ids map[string]uint32) Entries {
	e := Entries{Egress: map[LPMKey]uint32{}, Ingress: map[LPMKey]uint32{}, Verdicts: map[VKey]uint8{}}
	next := uint32(1)
	for _, id := range ids {
		next = max(next, id+1)
	}
	type node struct {
		p  netip.Prefix
		id uint32
	}
	for _, dir := range []Direction{Egress, Ingress} {
		lpm := e.Egress
		if dir == Ingress {
			lpm = e.Ingress
		}
		// Containers the same rules apply to (those of one subnet, as a
		// rule names them) share their nodes: computed once.
		done := map[string][]node{}
		for _, a := range local {
			// The rules that can apply to a's flows this way, in order.
			var rules []policy.Rule
			var which strings.Builder
			for i, r := range set {
				if fixed, _ := sides(r, dir); !fixed.IsValid() || fixed.Contains(a) {
					rules = append(rules, r)
					which.WriteString(strconv.Itoa(i) + ",")
				}
			}
			nodes, ok := done[which.String()]
			if !ok {
				prefixes := otherPrefixes(rules, dir)
				index := indexOther(rules, dir)
				tables := make([]map[cell]uint8, 0, len(prefixes))
				for _, p := range prefixes {
					if t := nodeTable(index.covering(p)); t != nil {
						tables = append(tables, t)
					}
				}
				if len(tables) < len(prefixes) {
					// Port ranges too wide for a table: not compiled, the
					// overlay judges this container's flows this way.
					done[which.String()] = nil
					continue
				}
				for i, p := range prefixes {
					table := tables[i]
					name := tableName(table)
					id, ok := ids[name]
					if !ok {
						id, next = next, next+1
						ids[name] = id
					}
					for c, v := range table {
						e.Verdicts[VKey{Node: id, Proto: c.proto, Port: c.port}] = v
					}
					nodes = append(nodes, node{p, id})
				}
				done[which.String()] = nodes
			}
			for _, n := range nodes {
				lpm[LPMKey{Local: a, Other: n.p}] = n.id
			}
		}
	}
	// Forget the ids of tables no node uses any more.
	used := map[uint32]bool{}
	for _, m := range []map[LPMKey]uint32{e.Egress, e.Ingress} {
		for _, id := range m {
			used[id] = true
		}
	}
	for name, id := range ids {
		if !used[id] {
			delete(ids, name)
		}
	}
	return e
}

// otherPrefixes are the distinct prefixes the rules name for the other
// end, and 0.0.0.0/0.
func otherPrefixes(rules []policy.Rule, dir Direction) []netip.Prefix {
	seen := map[netip.Prefix]bool{netip.PrefixFrom(netip.IPv4Unspecified(), 0): true}
	out := []netip.Prefix{netip.PrefixFrom(netip.IPv4Unspecified(), 0)}
	for _, r := range rules {
		if _, other := sides(r, dir); other.IsValid() && !seen[other] {
			seen[other] = true
			out = append(out, other)
		}
	}
	return out
}

// sides returns a rule's prefix on the local container's side and on the
// other end's (invalid: any).
func sides(r policy.Rule, dir Direction) (fixed, other netip.Prefix) {
	if dir == Egress {
		return r.Src, r.Dst
	}
	return r.Dst, r.Src
}

// MaxPortCells bounds the (protocol, port) cells of one node's table: a
// port range is a cell per port, and a container whose rules name more
// ports than this (wide ranges) is not compiled — the overlay judges it.
const MaxPortCells = 1024

// byOther finds the rules whose other-end prefix covers a prefix among
// its 33 ancestors, not by a look at every rule: compiling is O(prefixes
// × ancestors), not O(prefixes × rules) (10 000 rules of a /32 each took
// 1.9 s a compile).
type byOther struct {
	rules []policy.Rule
	at    map[netip.Prefix][]int // other-end prefix → its rules' indexes
	any   []int                  // the rules with no other-end prefix
}

func indexOther(rules []policy.Rule, dir Direction) byOther {
	x := byOther{rules: rules, at: map[netip.Prefix][]int{}}
	for i, r := range rules {
		if _, other := sides(r, dir); other.IsValid() {
			x.at[other] = append(x.at[other], i)
		} else {
			x.any = append(x.any, i)
		}
	}
	return x
}

// covering returns the rules whose other-end prefix covers p (p or a
// shorter prefix of its address; or none: any address), in their order.
func (x byOther) covering(p netip.Prefix) []policy.Rule {
	idx := slices.Clone(x.any)
	for bits := 0; bits <= p.Bits(); bits++ {
		q, _ := p.Addr().Prefix(bits)
		idx = append(idx, x.at[q]...)
	}
	slices.Sort(idx)
	out := make([]policy.Rule, len(idx))
	for i, j := range idx {
		out[i] = x.rules[j]
	}
	return out
}

// nodeTable is the verdict table of the addresses whose longest prefix
// among the rules' is p, from apply: the rules whose other-end prefix
// covers p (covering), which match every one of them, and only those.
// nil: the rules name more than MaxPortCells ports.
func nodeTable(apply []policy.Rule) map[cell]uint8 {
	cells := []cell{{protocols[policy.TCP], 0}, {protocols[policy.UDP], 0}, {protocols[policy.ICMP], 0}, {0, 0}}
	seen := map[cell]bool{}
	for _, r := range apply {
		for port := int(r.Port); r.Port != 0 && port <= int(r.LastPort()); port++ {
			if c := (cell{protocols[r.Proto], uint16(port)}); !seen[c] {
				if len(seen) == MaxPortCells {
					return nil
				}
				seen[c] = true
				cells = append(cells, c)
			}
		}
	}
	table := map[cell]uint8{}
	for _, c := range cells {
		table[c] = Allow // no rule matches: allowed
		for _, r := range apply {
			if matches(r, c) {
				table[c] = map[policy.Action]uint8{policy.Allow: Allow, policy.Deny: Deny}[r.Action]
				break
			}
		}
	}
	return table
}

// matches says whether r matches every flow of cell c: proto 0 stands for
// protocols no rule names, port 0 for ports no rule names.
func matches(r policy.Rule, c cell) bool {
	if r.Proto != "" && protocols[r.Proto] != c.proto {
		return false
	}
	return r.Port == 0 || c.port != 0 && r.MatchesPort(c.port)
}

// tableName is a canonical form of a table, its identity among nodes.
func tableName(t map[cell]uint8) string {
	keys := make([]cell, 0, len(t))
	for c := range t {
		keys = append(keys, c)
	}
	slices.SortFunc(keys, func(a, b cell) int { return int(a.proto)<<16 + int(a.port) - (int(b.proto)<<16 + int(b.port)) })
	var b strings.Builder
	for _, c := range keys {
		b.WriteString(strconv.Itoa(int(c.proto)) + "/" + strconv.Itoa(int(c.port)) + "=" + strconv.Itoa(int(t[c])) + ",")
	}
	return b.String()
}

// Verdict is what skp_verdict answers with these entries (Go's copy of the
// C lookup, for tests and for explaining a verdict).
func (e Entries) Verdict(dir Direction, local, other netip.Addr, proto uint8, port uint16) uint8 {
	lpm := e.Egress
	if dir == Ingress {
		lpm = e.Ingress
	}
	node, found := uint32(0), false
	for bits := 32; bits >= 0 && !found; bits-- {
		p, _ := other.Prefix(bits)
		node, found = lpm[LPMKey{Local: local, Other: p}]
	}
	if !found {
		return Unknown
	}
	if port != 0 {
		if v, ok := e.Verdicts[VKey{node, proto, port}]; ok {
			return v
		}
	}
	if v, ok := e.Verdicts[VKey{node, proto, 0}]; ok {
		return v
	}
	if v, ok := e.Verdicts[VKey{node, 0, 0}]; ok {
		return v
	}
	return Unknown
}

// lpmBytes is an LPM key as the kernel takes it (struct skp_lpm_key).
func lpmBytes(k LPMKey) []byte {
	b := binary.LittleEndian.AppendUint32(nil, uint32(32+k.Other.Bits()))
	l, o := k.Local.As4(), k.Other.Masked().Addr().As4()
	return append(append(b, l[:]...), o[:]...)
}

func (k LPMKey) String() string { return fmt.Sprintf("%s→%s", k.Local, k.Other) }
