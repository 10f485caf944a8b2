package bpfmap

import (
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// CounterNames names the counters of a per-CPU array keyed by a C enum, as
// the programs' BTF describes the map: the name of each key from 0 to the
// map's size, without prefix, in lower case (SKS_CONNECT_FAST with prefix
// "SKS_": "connect_fast"). A counter's name is so written once, in C.
func CounterNames(m *ebpf.MapSpec, prefix string) ([]string, error) {
	if m == nil {
		return nil, fmt.Errorf("counter names: no such map")
	}
	e, ok := btf.UnderlyingType(m.Key).(*btf.Enum)
	if !ok {
		return nil, fmt.Errorf("counter names of %s: its key is %v, not an enum", m.Name, m.Key)
	}
	names := make([]string, m.MaxEntries)
	for _, v := range e.Values {
		if v.Value < uint64(len(names)) {
			names[v.Value] = strings.ToLower(strings.TrimPrefix(v.Name, prefix))
		}
	}
	for i, n := range names {
		if n == "" {
			return nil, fmt.Errorf("counter names of %s: enum %s has no value %d", m.Name, e.Name, i)
		}
	}
	return names, nil
}

// MustCounterNames is CounterNames for the maps of skiff's own programs,
// whose BTF is built into the binary: a failure is a bug.
func MustCounterNames(spec func() (*ebpf.CollectionSpec, error), mapName, prefix string) []string {
	s, err := spec()
	if err != nil {
		panic(err)
	}
	names, err := CounterNames(s.Maps[mapName], prefix)
	if err != nil {
		panic(err)
	}
	return names
}

// NamedCounters reads the counters of m, named by names (CounterNames),
// summed over CPUs.
func NamedCounters(m *ebpf.Map, names []string) (map[string]uint64, error) {
	sums, err := Counters(m, len(names))
	if err != nil {
		return nil, err
	}
	out := make(map[string]uint64, len(names))
	for i, name := range names {
		out[name] = sums[i]
	}
	return out, nil
}
