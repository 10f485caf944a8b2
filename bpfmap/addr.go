package bpfmap

import (
	"encoding/binary"
	"net/netip"
)

// IPv4 is an IPv4 address as programs read it from a packet or a socket
// (network order in memory) and as maps keyed by it hold it.
func IPv4(a netip.Addr) uint32 {
	b := a.As4()
	return binary.NativeEndian.Uint32(b[:])
}

// Addr is the address IPv4 holds.
func Addr(v uint32) netip.Addr {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

// Port is a port in network order in memory, as programs compare it with
// a packet's bytes.
func Port(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}
