// Package bpfmap reads and deletes eBPF map entries in bulk: one system
// call for hundreds of entries where the map type has batch operations
// (hash maps, LRU or not, LPM tries), one per entry where it has not
// (sockhashes); and runs iterator programs.
package bpfmap

import (
	"errors"
	"fmt"
	"io"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// batch is how many entries one system call moves.
const batch = 512

// Entries returns every entry of m.
func Entries[K comparable, V any](m *ebpf.Map) (map[K]V, error) {
	out := map[K]V{}
	var cursor ebpf.MapBatchCursor
	keys, vals := make([]K, batch), make([]V, batch)
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			out[keys[i]] = vals[i]
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil // the end
		}
		if err != nil {
			break // no batches for this map type, or a hash bucket larger than a batch
		}
	}
	clear(out)
	var k K
	var v V
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", m, err)
	}
	return out, nil
}

// Delete deletes keys from m and returns how many it deleted. Keys already
// gone (an LRU map evicted them, a program deleted them) are skipped.
func Delete[K any](m *ebpf.Map, keys []K) (int, error) {
	deleted := 0
	for len(keys) > 0 {
		// The kernel deletes in order and stops at the first key it
		// cannot: n were deleted, keys[n] is the one that failed.
		n, err := m.BatchDelete(keys[:min(len(keys), batch)], nil)
		if errors.Is(err, ebpf.ErrNotSupported) {
			n, err := deleteEach(m, keys) // (no count came back)
			return deleted + n, err
		}
		deleted += n
		keys = keys[n:]
		switch {
		case err == nil:
		case errors.Is(err, ebpf.ErrKeyNotExist):
			keys = keys[1:]
		default:
			return deleted, fmt.Errorf("delete from %s: %w", m, err)
		}
	}
	return deleted, nil
}

// deleteEach deletes keys one at a time, skipping those already gone, and
// returns how many it deleted and the first failure.
func deleteEach[K any](m *ebpf.Map, keys []K) (int, error) {
	n := 0
	var first error
	for _, k := range keys {
		err := m.Delete(k)
		switch {
		case err == nil:
			n++
		case errors.Is(err, ebpf.ErrKeyNotExist):
		case first == nil:
			first = fmt.Errorf("delete from %s: %w", m, err)
		}
	}
	return n, first
}

// Counters sums the first n entries of a per-CPU array of uint64 counters
// over CPUs, by index.
func Counters(m *ebpf.Map, n int) ([]uint64, error) {
	out := make([]uint64, n)
	var perCPU []uint64
	for i := range out {
		if err := m.Lookup(uint32(i), &perCPU); err != nil {
			return nil, fmt.Errorf("read counter %d of %s: %w", i, m, err)
		}
		for _, v := range perCPU {
			out[i] += v
		}
	}
	return out, nil
}

// Iterate runs an iterator program once over what it walks (for iter/tcp:
// the sockets of the calling process's network namespace) and returns
// what it wrote.
func Iterate(prog *ebpf.Program) ([]byte, error) {
	it, err := link.AttachIter(link.IterOptions{Program: prog})
	if err != nil {
		return nil, fmt.Errorf("iterator %s: %w", prog, err)
	}
	defer it.Close()
	rd, err := it.Open()
	if err != nil {
		return nil, fmt.Errorf("iterator %s: %w", prog, err)
	}
	defer rd.Close()
	return io.ReadAll(rd)
}
