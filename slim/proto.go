// Package slim runs the two papers' own designs of TCP through host
// sockets, for skiff bench to measure beside skiff's sockets layer: Slim
// (Zhuo et al., NSDI '19) and SlimFast (IEEE TCC '23). Each is a
// user-space router per host, in the host's network namespace, that
// hands containers host TCP sockets over a Unix socket (SCM_RIGHTS); a
// preloaded shim (shim/slim.c, libslim.so) puts them in place of the
// application's sockets.
//
// Slim: the application's socket has a host twin from the router; at
// accept the server's shim sends the twin's host address to the client
// over the overlay connection, and both sides' routers connect and accept
// the twins. SlimFast: the server registers its overlay address with its
// router, and the client's router connects to the server host's router
// port (8888) and names the destination in a 20-byte header; no overlay
// packet at all. docs/design/slim.md has the papers' steps and figures.
package slim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
)

// Wire formats, as slim_proto.h in the shim. Between shim and router
// (one SOCK_SEQPACKET message each): integers little-endian, addresses
// in network order, ports in host order. Between hosts: big-endian.
const (
	Magic     = 0x4d494c53 // "SLIM"
	PushMagic = 0x55504653 // "SFPU"
	HdrMagic  = 0x53464831 // "SFH1"

	ReqLen  = 24
	RspLen  = 16
	PushLen = 12
	HdrLen  = 20 // SlimFast's header on a host connection to the router port

	// DefaultPort is SlimFast's router port on every host.
	DefaultPort = 8888
)

// Operations.
const (
	OpSocket   = 1  // Slim: a host socket (reply: its fd)
	OpBind     = 2  // Slim: bind the passed host socket to the host address, any port
	OpAccept   = 3  // Slim: accept on the passed host listener (reply: the connection's fd)
	OpConnect  = 4  // Slim: connect the passed host socket to ip:port
	OpRegister = 16 // SlimFast: listen on ip:port (and extra addresses); the connection stays open
	OpFConnect = 17 // SlimFast: a host connection to the owner of ip:port (reply: its fd)
	OpUSocket  = 18 // SlimFast: a host UDP socket (reply: its fd, bound address); with an address, a registration kept open
	OpULookup  = 19 // SlimFast: the relay of the host ip lives on
	OpList     = 32 // SlimFast: the registered addresses
)

// FlagNonblock asks for a non-blocking host socket (SOCK_NONBLOCK);
// FlagUDP asks List for the registered UDP sockets.
const (
	FlagNonblock = 1
	FlagUDP      = 2
)

// Req is a shim's request.
type Req struct {
	Op    uint16
	Flags uint16
	Addr  netip.AddrPort // Connect: the host address; Register, FConnect: the overlay address
	Src   netip.Addr     // FConnect: the client's overlay address
	Arg   int32
	Extra []netip.Addr // Register: more addresses with the same port
}

// Rsp is the router's reply: Err is 0 or an errno.
type Rsp struct {
	Err   int32
	Addr  netip.AddrPort // Bind, USocket: the bound host address; Accept: the peer's
	Relay uint16         // USocket: this host's relay port
	List  []netip.AddrPort
}

func put4(b []byte, a netip.Addr) {
	if a.Is4() {
		v := a.As4()
		copy(b, v[:])
	}
}

func get4(b []byte) netip.Addr { return netip.AddrFrom4([4]byte(b[:4])) }

// Encode lays r out as the shim does.
func (r Req) Encode() []byte {
	b := make([]byte, ReqLen+4*len(r.Extra))
	le := binary.LittleEndian
	le.PutUint32(b[0:], Magic)
	le.PutUint16(b[4:], r.Op)
	le.PutUint16(b[6:], r.Flags)
	put4(b[8:], r.Addr.Addr())
	le.PutUint16(b[12:], r.Addr.Port())
	le.PutUint16(b[14:], uint16(len(r.Extra)))
	put4(b[16:], r.Src)
	le.PutUint32(b[20:], uint32(r.Arg))
	for i, a := range r.Extra {
		put4(b[ReqLen+4*i:], a)
	}
	return b
}

// DecodeReq reads a request.
func DecodeReq(b []byte) (Req, error) {
	le := binary.LittleEndian
	if len(b) < ReqLen || le.Uint32(b) != Magic {
		return Req{}, fmt.Errorf("slim: a request of %d bytes, not %d with the magic", len(b), ReqLen)
	}
	r := Req{Op: le.Uint16(b[4:]), Flags: le.Uint16(b[6:]), Addr: netip.AddrPortFrom(get4(b[8:]), le.Uint16(b[12:])),
		Src: get4(b[16:]), Arg: int32(le.Uint32(b[20:]))}
	n := int(le.Uint16(b[14:]))
	if len(b) != ReqLen+4*n {
		return Req{}, errors.New("slim: request length does not match its address count")
	}
	for i := range n {
		r.Extra = append(r.Extra, get4(b[ReqLen+4*i:]))
	}
	return r, nil
}

// Encode lays r out as the shim reads it.
func (r Rsp) Encode() []byte {
	b := make([]byte, RspLen+8*len(r.List))
	le := binary.LittleEndian
	le.PutUint32(b[0:], uint32(r.Err))
	put4(b[4:], r.Addr.Addr())
	le.PutUint16(b[8:], r.Addr.Port())
	le.PutUint16(b[10:], r.Relay)
	le.PutUint32(b[12:], uint32(len(r.List)))
	for i, ap := range r.List {
		put4(b[RspLen+8*i:], ap.Addr())
		le.PutUint16(b[RspLen+8*i+4:], ap.Port())
	}
	return b
}

// DecodeRsp reads a reply.
func DecodeRsp(b []byte) (Rsp, error) {
	le := binary.LittleEndian
	if len(b) < RspLen {
		return Rsp{}, fmt.Errorf("slim: a reply of %d bytes", len(b))
	}
	r := Rsp{Err: int32(le.Uint32(b)), Addr: netip.AddrPortFrom(get4(b[4:]), le.Uint16(b[8:])), Relay: le.Uint16(b[10:])}
	n := int(le.Uint32(b[12:]))
	if len(b) != RspLen+8*n {
		return Rsp{}, errors.New("slim: reply length does not match its count")
	}
	for i := range n {
		r.List = append(r.List, netip.AddrPortFrom(get4(b[RspLen+8*i:]), le.Uint16(b[RspLen+8*i+4:])))
	}
	return r, nil
}

// Hdr is SlimFast's header: the first bytes of a host connection to a
// router port, naming the server container and the client.
type Hdr struct {
	Dst, Src netip.AddrPort
}

func (h Hdr) Encode() []byte {
	b := make([]byte, HdrLen)
	be := binary.BigEndian
	be.PutUint32(b[0:], HdrMagic)
	put4(b[4:], h.Dst.Addr())
	be.PutUint16(b[8:], h.Dst.Port())
	be.PutUint16(b[10:], h.Src.Port())
	put4(b[12:], h.Src.Addr())
	return b
}

func DecodeHdr(b []byte) (Hdr, error) {
	be := binary.BigEndian
	if len(b) != HdrLen || be.Uint32(b) != HdrMagic {
		return Hdr{}, errors.New("slim: not a SlimFast header")
	}
	return Hdr{Dst: netip.AddrPortFrom(get4(b[4:]), be.Uint16(b[8:])), Src: netip.AddrPortFrom(get4(b[12:]), be.Uint16(b[10:]))}, nil
}

// push is what the router sends a registered listener with a connection's fd.
func push(src netip.AddrPort) []byte {
	b := make([]byte, PushLen)
	le := binary.LittleEndian
	le.PutUint32(b[0:], PushMagic)
	put4(b[4:], src.Addr())
	le.PutUint16(b[8:], src.Port())
	return b
}

// SlimFast's UDP (§III-C): a datagram of a flow whose direct address is
// not known yet carries a tag in front of its payload. Its two address
// fields by leg: client → the server host's relay: A the destination's
// overlay address, B the client's; relay → server: A the client's overlay
// address, B its host address; server → client, until the client sends
// direct: A the server's overlay address.
const (
	UDPMagic = 0x53465531 // "SFU1"
	TagLen   = 16
	// DefaultRelayPort is SlimFast's UDP relay port on every host.
	DefaultRelayPort = 9999
)

// Tag is a datagram's tag.
type Tag struct{ A, B netip.AddrPort }

func (g Tag) Encode() []byte {
	b := make([]byte, TagLen)
	be := binary.BigEndian
	be.PutUint32(b[0:], UDPMagic)
	put4(b[4:], g.A.Addr())
	be.PutUint16(b[8:], g.A.Port())
	be.PutUint16(b[10:], g.B.Port())
	put4(b[12:], g.B.Addr())
	return b
}

// DecodeTag reads the tag at the front of a datagram.
func DecodeTag(b []byte) (Tag, bool) {
	be := binary.BigEndian
	if len(b) < TagLen || be.Uint32(b) != UDPMagic {
		return Tag{}, false
	}
	return Tag{A: netip.AddrPortFrom(get4(b[4:]), be.Uint16(b[8:])), B: netip.AddrPortFrom(get4(b[12:]), be.Uint16(b[10:]))}, true
}
