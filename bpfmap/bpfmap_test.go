package bpfmap

import (
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

func newMap(t testing.TB, typ ebpf.MapType, keySize uint32, entries uint32) *ebpf.Map {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("creating eBPF maps needs root")
	}
	spec := &ebpf.MapSpec{Type: typ, KeySize: keySize, ValueSize: 4, MaxEntries: entries}
	if typ == ebpf.SockHash {
		spec.ValueSize = 8 // a socket's fd in, its cookie out
	}
	if typ == ebpf.LPMTrie {
		spec.Flags = 1 // BPF_F_NO_PREALLOC
	}
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// lpmKey is an LPM trie key: a prefix length and an IPv4 address.
type lpmKey struct {
	Prefixlen uint32
	IP        uint32
}

func TestEntries(t *testing.T) {
	const n = 1500 // three batches
	for _, typ := range []ebpf.MapType{ebpf.Hash, ebpf.LRUHash} {
		m := newMap(t, typ, 4, 4096)
		for i := range uint32(n) {
			if err := m.Put(i, i*10); err != nil {
				t.Fatal(err)
			}
		}
		got, err := Entries[uint32, uint32](m)
		if err != nil {
			t.Fatalf("%s: %v", typ, err)
		}
		if len(got) != n {
			t.Fatalf("%s: %d entries, want %d", typ, len(got), n)
		}
		for k, v := range got {
			if v != k*10 {
				t.Fatalf("%s: entry %d = %d, want %d", typ, k, v, k*10)
			}
		}
	}
	m := newMap(t, ebpf.LPMTrie, 8, 64)
	for i := range uint32(20) {
		if err := m.Put(lpmKey{32, i}, i); err != nil {
			t.Fatal(err)
		}
	}
	got, err := Entries[lpmKey, uint32](m)
	if err != nil || len(got) != 20 || got[lpmKey{32, 7}] != 7 {
		t.Fatalf("LPM trie: %d entries (%v), entry 7 = %d", len(got), err, got[lpmKey{32, 7}])
	}
	// A sockhash has no batch operations: read one by one.
	m = newMap(t, ebpf.SockHash, 4, 64)
	cookies := putSockets(t, m, 3)
	all, err := Entries[uint32, uint64](m)
	if err != nil || len(all) != 3 || all[2] != cookies[2] {
		t.Fatalf("sockhash: %v (%v), want %v", all, err, cookies)
	}
}

// putSockets puts n connected sockets into the sockhash m, at keys 0 to
// n-1, and returns their cookies.
func putSockets(t *testing.T, m *ebpf.Map, n int) []uint64 {
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var cookies []uint64
	for i := range n {
		c, err := net.Dial("tcp4", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		f, err := c.(*net.TCPConn).File()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		if err := m.Put(uint32(i), uint64(f.Fd())); err != nil {
			t.Fatal(err)
		}
		cookie, err := unix.GetsockoptUint64(int(f.Fd()), unix.SOL_SOCKET, unix.SO_COOKIE)
		if err != nil {
			t.Fatal(err)
		}
		cookies = append(cookies, cookie)
	}
	return cookies
}

func TestDelete(t *testing.T) {
	for _, typ := range []ebpf.MapType{ebpf.Hash, ebpf.LRUHash} {
		m := newMap(t, typ, 4, 4096)
		for i := range uint32(2000) {
			if err := m.Put(i, i); err != nil {
				t.Fatal(err)
			}
		}
		// Every other key, and between them keys that are not there
		// (each stops a batch): the even ones below 2000 go.
		var keys []uint32
		for i := uint32(0); i < 3000; i += 2 {
			keys = append(keys, i)
			if i%7 == 0 {
				keys = append(keys, 5000+i)
			}
		}
		n, err := Delete(m, keys)
		if err != nil || n != 1000 {
			t.Fatalf("%s: deleted %d (%v), want 1000", typ, n, err)
		}
		left, _ := Entries[uint32, uint32](m)
		if len(left) != 1000 {
			t.Fatalf("%s: %d entries left, want 1000", typ, len(left))
		}
		for k := range left {
			if k%2 == 0 {
				t.Fatalf("%s: %d survived", typ, k)
			}
		}
	}
	m := newMap(t, ebpf.LPMTrie, 8, 64)
	for i := range uint32(10) {
		if err := m.Put(lpmKey{32, i}, i); err != nil {
			t.Fatal(err)
		}
	}
	n, err := Delete(m, []lpmKey{{32, 1}, {32, 99}, {32, 3}})
	if err != nil || n != 2 {
		t.Fatalf("LPM trie: deleted %d (%v), want 2", n, err)
	}
	if left, _ := Entries[lpmKey, uint32](m); len(left) != 8 {
		t.Fatalf("LPM trie: %d entries left, want 8", len(left))
	}
	// A sockhash has no batch operations: one by one.
	m = newMap(t, ebpf.SockHash, 4, 64)
	putSockets(t, m, 4)
	n, err = Delete(m, []uint32{0, 9, 2})
	if err != nil || n != 2 {
		t.Fatalf("sockhash: deleted %d (%v), want 2", n, err)
	}
	if left, _ := Entries[uint32, uint64](m); len(left) != 2 || left[1] == 0 || left[3] == 0 {
		t.Fatalf("sockhash: %v left, want keys 1 and 3", left)
	}
}

// TestAddr: addresses and ports take the bytes of a packet.
func TestAddr(t *testing.T) {
	a := netip.MustParseAddr("10.1.2.3")
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], IPv4(a))
	if b != [4]byte{10, 1, 2, 3} || Addr(IPv4(a)) != a {
		t.Errorf("IPv4(%v) = %#x, bytes %v", a, IPv4(a), b)
	}
	var p [2]byte
	binary.NativeEndian.PutUint16(p[:], Port(4789))
	if p != [2]byte{0x12, 0xb5} {
		t.Errorf("Port(4789) bytes %v", p)
	}
}
