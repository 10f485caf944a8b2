// Package tctest builds packets for golden-packet tests of tc programs and
// runs programs on them with BPF_PROG_RUN: just enough Ethernet, IPv4,
// TCP/UDP/ICMP and VXLAN to write the cases down readably.
package tctest

import (
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

// Protocol numbers and TCP flags.
const (
	ProtoICMP = 1
	ProtoTCP  = 6
	ProtoUDP  = 17

	FIN = 0x01
	SYN = 0x02
	RST = 0x04
	PSH = 0x08
	ACK = 0x10
)

// Eth builds an Ethernet frame.
func Eth(dst, src net.HardwareAddr, typ uint16, payload []byte) []byte {
	b := append(append([]byte{}, dst...), src...)
	b = binary.BigEndian.AppendUint16(b, typ)
	return append(b, payload...)
}

// IPOpts are the IPv4 header fields tests vary.
type IPOpts struct {
	TOS, TTL byte
	Options  []byte // makes IHL > 5
	Frag     uint16 // flags+offset field
	ID       uint16
}

// Csum is the Internet checksum of b.
func Csum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// IPv4 builds an IPv4 packet with a correct header checksum.
func IPv4(o IPOpts, proto byte, src, dst netip.Addr, payload []byte) []byte {
	if o.TTL == 0 {
		o.TTL = 64
	}
	hl := 20 + len(o.Options)
	h := make([]byte, hl)
	h[0] = 0x40 | byte(hl/4)
	h[1] = o.TOS
	binary.BigEndian.PutUint16(h[2:], uint16(hl+len(payload)))
	binary.BigEndian.PutUint16(h[4:], o.ID)
	binary.BigEndian.PutUint16(h[6:], o.Frag)
	h[8], h[9] = o.TTL, proto
	s, d := src.As4(), dst.As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	copy(h[20:], o.Options)
	binary.BigEndian.PutUint16(h[10:], Csum(h))
	return append(h, payload...)
}

// TCP builds a TCP segment (checksum not filled in).
func TCP(sport, dport uint16, flags byte, payload []byte) []byte {
	return TCPWithOptions(sport, dport, flags, nil, payload)
}

// TCPWithOptions builds a TCP segment with options (padded to 4 bytes with
// NOPs, as Linux does).
func TCPWithOptions(sport, dport uint16, flags byte, opts, payload []byte) []byte {
	for len(opts)%4 != 0 {
		opts = append(opts, 1)
	}
	h := make([]byte, 20, 20+len(opts))
	binary.BigEndian.PutUint16(h[0:], sport)
	binary.BigEndian.PutUint16(h[2:], dport)
	binary.BigEndian.PutUint32(h[4:], 1000)
	binary.BigEndian.PutUint32(h[8:], 2000)
	h[12] = byte((20+len(opts))/4) << 4
	h[13] = flags
	binary.BigEndian.PutUint16(h[14:], 65535)
	return append(append(h, opts...), payload...)
}

// UDP builds a UDP datagram (checksum 0).
func UDP(sport, dport uint16, payload []byte) []byte {
	h := make([]byte, 8)
	binary.BigEndian.PutUint16(h[0:], sport)
	binary.BigEndian.PutUint16(h[2:], dport)
	binary.BigEndian.PutUint16(h[4:], uint16(8+len(payload)))
	return append(h, payload...)
}

// ICMP builds an ICMP message of type typ.
func ICMP(typ byte, payload []byte) []byte {
	h := []byte{typ, 0, 0, 0, 0, 1, 0, 1}
	return append(h, payload...)
}

// VXLAN wraps an inner frame the way the overlay's VXLAN device does.
func VXLAN(outer IPOpts, srcMAC, dstMAC net.HardwareAddr, src, dst netip.Addr, vni uint32, dport uint16, inner []byte) []byte {
	vx := []byte{0x08, 0, 0, 0, byte(vni >> 16), byte(vni >> 8), byte(vni), 0}
	return Eth(dstMAC, srcMAC, 0x0800, IPv4(outer, ProtoUDP, src, dst, UDP(50000, dport, append(vx, inner...))))
}

// Run runs prog on packet in and returns its verdict and output packet.
func Run(t *testing.T, prog *ebpf.Program, in []byte) (uint32, []byte) {
	t.Helper()
	ret, out, _ := RunSkb(t, prog, in, nil)
	return ret, out
}

// Skb is the start of struct __sk_buff: the fields a test reads back.
type Skb struct {
	Len, PktType, Mark uint32
}

// RunSkb runs prog on in with skb fields ctx (nil: zero) and returns the
// verdict, the output packet and the skb fields after the run.
func RunSkb(t *testing.T, prog *ebpf.Program, in []byte, ctx *Skb) (uint32, []byte, Skb) {
	t.Helper()
	// struct __sk_buff is 192 bytes; the kernel copies back what it allows.
	ctxIn := make([]byte, 192)
	if ctx != nil {
		binary.NativeEndian.PutUint32(ctxIn[8:], ctx.Mark)
	}
	ctxOut := make([]byte, 192)
	opts := &ebpf.RunOptions{Data: in, DataOut: make([]byte, len(in)+256), Context: ctxIn, ContextOut: ctxOut}
	ret, err := prog.Run(opts)
	if err != nil {
		t.Fatalf("BPF_PROG_RUN: %v", err)
	}
	out := Skb{binary.NativeEndian.Uint32(ctxOut[0:]), binary.NativeEndian.Uint32(ctxOut[4:]), binary.NativeEndian.Uint32(ctxOut[8:])}
	return ret, opts.DataOut, out
}

// EnumNames reads the constants of enum name in the C header file, in
// order, without prefix and the last one (the count) and in lower case:
// what a Go list naming the program's counters must say.
func EnumNames(t *testing.T, file, name, prefix string) []string {
	t.Helper()
	h, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	enum := regexp.MustCompile(`(?s)enum ` + name + ` \{(.*?)\};`).FindSubmatch(h)
	if enum == nil {
		t.Fatalf("no enum %s in %s", name, file)
	}
	var names []string
	for _, m := range regexp.MustCompile(`(?m)^\s*`+prefix+`(\w+),`).FindAllSubmatch(enum[1], -1) {
		names = append(names, strings.ToLower(string(m[1])))
	}
	if len(names) == 0 {
		t.Fatalf("enum %s in %s has no constant %s*", name, file, prefix)
	}
	return names[:len(names)-1]
}
