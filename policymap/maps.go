package policymap

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/policy"
)

// Maps are policymap.h's maps in a program's collection, kept equal to the
// rule set compiled for this host's containers.
type Maps struct {
	Egress, Ingress, Verdicts *ebpf.Map
	ids                       map[string]uint32
	have                      Entries
}

// vkey is struct skp_vkey.
type vkey struct {
	Node  uint32
	Port  uint16
	Proto uint8
	Pad   uint8
}

// Sync compiles set for the local containers and brings the maps to it
// without a moment in which a program could read a node without its
// verdicts: new verdicts first, then the prefixes (each replaced in
// place), then what no longer applies. A map too small for the policy is
// an error, and what was there stays (programs keep the last policy that
// fit; the caller sends flows to the overlay).
func (m *Maps) Sync(set policy.Set, local []netip.Addr) error {
	if m.ids == nil {
		m.ids = map[string]uint32{}
	}
	want := Compile(set, local, m.ids)
	if n, max := len(want.Verdicts), int(m.Verdicts.MaxEntries()); n > max {
		return fmt.Errorf("the policy needs %d verdicts, the map holds %d", n, max)
	}
	for _, c := range []struct {
		n   int
		m   *ebpf.Map
		dir string
	}{{len(want.Egress), m.Egress, "egress"}, {len(want.Ingress), m.Ingress, "ingress"}} {
		if c.n > int(c.m.MaxEntries()) {
			return fmt.Errorf("the policy needs %d %s prefixes, the map holds %d", c.n, c.dir, c.m.MaxEntries())
		}
	}
	for k, v := range want.Verdicts {
		if old, ok := m.have.Verdicts[k]; !ok || old != v {
			if err := m.Verdicts.Put(vkey{Node: k.Node, Port: k.Port, Proto: k.Proto}, v); err != nil {
				return fmt.Errorf("policy verdict %+v: %w", k, err)
			}
		}
	}
	for _, c := range []struct {
		m          *ebpf.Map
		want, have map[LPMKey]uint32
	}{{m.Egress, want.Egress, m.have.Egress}, {m.Ingress, want.Ingress, m.have.Ingress}} {
		for k, id := range c.want {
			if old, ok := c.have[k]; !ok || old != id {
				if err := c.m.Put(lpmBytes(k), id); err != nil {
					return fmt.Errorf("policy prefix %s: %w", k, err)
				}
			}
		}
	}
	var errs []error
	for _, c := range []struct {
		m          *ebpf.Map
		want, have map[LPMKey]uint32
	}{{m.Egress, want.Egress, m.have.Egress}, {m.Ingress, want.Ingress, m.have.Ingress}} {
		for k := range c.have {
			if _, ok := c.want[k]; !ok {
				if err := c.m.Delete(lpmBytes(k)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
					errs = append(errs, err)
				}
			}
		}
	}
	for k := range m.have.Verdicts {
		if _, ok := want.Verdicts[k]; !ok {
			if err := m.Verdicts.Delete(vkey{Node: k.Node, Port: k.Port, Proto: k.Proto}); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				errs = append(errs, err)
			}
		}
	}
	m.have = want
	return errors.Join(errs...)
}

// Add compiles set for one more local container, a, and writes its
// entries, leaving every other container's as they are: what a
// container's ADD costs is its own share of the rules, not the host's.
// set must be the set the maps were last synced with. New tables get ids
// no node uses; tables no node uses any more stay until the next Sync.
func (m *Maps) Add(set policy.Set, a netip.Addr) error {
	if m.ids == nil {
		return errors.New("policy maps never synced")
	}
	ids := maps.Clone(m.ids) // Compile forgets the ids a's nodes do not use
	want := Compile(set, []netip.Addr{a}, ids)
	for k, v := range want.Verdicts {
		if old, ok := m.have.Verdicts[k]; ok && old == v {
			continue
		}
		if err := m.Verdicts.Put(vkey{Node: k.Node, Port: k.Port, Proto: k.Proto}, v); err != nil {
			return fmt.Errorf("policy verdict %+v: %w", k, err)
		}
		m.have.Verdicts[k] = v
	}
	maps.Copy(m.ids, ids)
	for _, c := range []struct {
		m          *ebpf.Map
		want, have map[LPMKey]uint32
	}{{m.Egress, want.Egress, m.have.Egress}, {m.Ingress, want.Ingress, m.have.Ingress}} {
		for k, id := range c.want {
			if old, ok := c.have[k]; ok && old == id {
				continue
			}
			if err := c.m.Put(lpmBytes(k), id); err != nil {
				return fmt.Errorf("policy prefix %s: %w", k, err)
			}
			c.have[k] = id
		}
	}
	return nil
}

// Remove deletes a local container's prefixes (its tables' verdicts stay
// until the next Sync).
func (m *Maps) Remove(a netip.Addr) error {
	var errs []error
	for _, c := range []struct {
		m    *ebpf.Map
		have map[LPMKey]uint32
	}{{m.Egress, m.have.Egress}, {m.Ingress, m.have.Ingress}} {
		for k := range c.have {
			if k.Local != a {
				continue
			}
			if err := c.m.Delete(lpmBytes(k)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				errs = append(errs, err)
				continue
			}
			delete(c.have, k)
		}
	}
	return errors.Join(errs...)
}
