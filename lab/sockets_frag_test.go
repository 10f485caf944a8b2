package lab

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/policy"
)

// pyOptionSYN sends one SYN carrying skiff's option from a raw socket and
// prints what answers it: "synack" (a listener took it), "rst" or "none".
// argv = dst host, dst overlay ip, port, claimed overlay source, shape:
//
//	whole   one unfragmented packet
//	tiny    IP fragments, the first with 8 bytes of TCP (ports and
//	        sequence number only), the rest of the header, the option and
//	        96 bytes of data in the second
//	mf      the whole header with the option in a first fragment (MF
//	        set), the data in the second
//	middle  a plain SYN header in the first fragment; the second, at
//	        offset 24, starts with a header of the same ports carrying the
//	        option (a recorder that parses any fragment as TCP sees an
//	        option SYN; the reassembled packet is a plain SYN with data)
//
// The fragments share an IP ID; the kernel fills in the IP checksum and
// length (IPPROTO_RAW). A SYN-ACK's answer by the sender's own kernel (a
// RST: no socket has the port) comes after the reply was seen.
const pyOptionSYN = `
import os, random, socket, struct, sys, time
dst, ovl_dst, port, ovl_src, shape = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
` + pySYNOption + `
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.connect((dst, 9))
src = u.getsockname()[0]
sport = random.randint(20000, 60000)
opts = bytes([2, 4, 5, 0xb4]) + bytes([1] * 16) + skiff_option(ovl_dst, port, ovl_src)
def tcp(options):
    return struct.pack("!HHIIBBHHH", sport, port, 1000, 0, (20 + len(options)) // 4 << 4, 0x02, 65535, 0, 0) + options
if shape == "middle":
    seg = tcp(b"") + b"abcd" + tcp(opts) + bytes(32)
else:
    seg = tcp(opts) + (bytes(96) if shape != "whole" else b"")
pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(seg))
seg = seg[:16] + struct.pack("!H", csum(pseudo + seg)) + seg[18:]
cut = {"whole": len(seg), "tiny": 8, "mf": 56 + 8, "middle": 24}[shape]
ident = random.randint(1, 65535)
def ip(payload, off, more):
    flags = (0x2000 if more else 0) | (off // 8)
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), ident, flags, 64, 6, 0,
                       socket.inet_aton(src), socket.inet_aton(dst)) + payload
rx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
tx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
frags = [ip(seg[:cut], 0, cut < len(seg))]
if cut < len(seg):
    frags.append(ip(seg[cut:], cut, False))
for f in frags:
    tx.sendto(f, (dst, 0))
deadline = time.time() + 1.5
got = "none"
while time.time() < deadline:
    rx.settimeout(max(deadline - time.time(), 0.01))
    try:
        p = rx.recv(1500)
    except socket.timeout:
        break
    h = (p[0] & 0xf) * 4
    if p[12:16] != socket.inet_aton(dst) or struct.unpack("!HH", p[h:h + 4]) != (port, sport):
        continue
    flags = p[h + 13]
    got = "synack" if flags & 0x12 == 0x12 else "rst" if flags & 0x04 else "other %#x" % flags
    break
print(got)
`

// optionSYN sends one option SYN of shape from target to h1's underlay
// address (claiming claim, for srv) and returns what answered it.
func optionSYN(t *testing.T, l *Lab, target string, srv netip.AddrPort, claim netip.Addr, shape string) string {
	t.Helper()
	return strings.TrimSpace(runPy(t, l, target, pyOptionSYN, nil, l.Hosts[0].UnderlayIP.String(),
		srv.Addr().String(), fmt.Sprint(srv.Port()), claim.String(), shape))
}

// TestSocketsFragmentedSYN: a container with CAP_NET_RAW (lab containers
// run as root) sends skiff's option SYN in IP fragments, claiming another
// container of its host. Its host reassembles and re-fragments it on the
// way out (conntrack), so the server's host sees the option whole in a
// first fragment. Before, neither end checked for fragments: the
// container's veth could not read the option in an 8-byte first fragment,
// the server's recorder took the re-fragmented one, and the replaced
// listener answered a connection from the neighbour it claimed. Now
// neither a container's TCP fragments nor an option SYN in fragments steer
// anything; the same SYN whole from the host (trusted) still does.
func TestSocketsFragmentedSYN(t *testing.T) {
	l := newLab(t, Config{Name: "tskfrag", Hosts: 2, ContainersPerHost: 2, Mode: "sockets"})
	srv := replacedServer(t, l, pyEcho, "h2/c1")
	neighbour, _ := l.IP("h2/c2")
	own, _ := l.IP("h2/c1")

	assigned := counter(t, l, "h1", "assigned")
	// From the container: its veth drops TCP fragments (no answer); before,
	// the listener answered.
	for _, shape := range []string{"tiny", "mf"} {
		if got := optionSYN(t, l, "h2/c1", srv, neighbour, shape); got != "none" {
			t.Errorf("option SYN (%s fragments) from h2/c1 claiming h2/c2: %s, want none", shape, got)
		}
	}
	if counter(t, l, "h2", "tcp_fragment") == 0 {
		t.Error("h2 counted no refused TCP fragment")
	}
	// Whole, from the container: dropped as forged, as before.
	if got := optionSYN(t, l, "h2/c1", srv, neighbour, "whole"); got != "none" {
		t.Errorf("option SYN (whole) from h2/c1: %s, want none", got)
	}
	// From h2's host namespace (as a host that re-fragmented it would
	// send it): the recorder takes no fragment, and drops a first
	// fragment that is a SYN.
	fragmented := counter(t, l, "h1", "tcp_fragment")
	for _, shape := range []string{"tiny", "mf", "middle"} {
		if got := optionSYN(t, l, "h2", srv, own, shape); got != "none" {
			t.Errorf("option SYN (%s fragments) from h2's host: %s, want none", shape, got)
		}
	}
	if n := counter(t, l, "h1", "tcp_fragment"); n < fragmented+3 {
		t.Errorf("h1's tcp_fragment %d → %d, want +3", fragmented, n)
	}
	if n := counter(t, l, "h1", "assigned"); n != assigned {
		t.Errorf("h1 steered %d fragmented SYNs to the replaced listener", n-assigned)
	}
	// The same SYN whole from the host is recorded and steered.
	if got := optionSYN(t, l, "h2", srv, own, "whole"); got != "synack" {
		t.Errorf("option SYN (whole) from h2's host: %s, want synack", got)
	}
	// A container's large datagrams still cross the overlay in fragments.
	srvIP, _ := l.IP("h1/c2")
	udpEcho(t, l, "h1/c2", 7300)
	if got := strings.TrimSpace(runPy(t, l, "h2/c1", pyBigDatagram, nil, srvIP.String(), "7300")); got != "4000" {
		t.Errorf("a 4000-byte datagram over the overlay: %q", got)
	}
}

// pyUDPEcho echoes datagrams on argv[1].
const pyUDPEcho = `
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("up", flush=True)
while True:
    d, a = s.recvfrom(65536)
    s.sendto(d, a)
`

// pyBigDatagram sends a 4000-byte datagram (fragments at the veth's MTU)
// to argv[1]:argv[2] and prints the length of the echo.
const pyBigDatagram = `
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(3)
for i in range(3):
    s.sendto(b"x" * 4000, (sys.argv[1], int(sys.argv[2])))
    try:
        print(len(s.recv(65536)))
        break
    except socket.timeout:
        pass
else:
    print("timeout")
`

func udpEcho(t *testing.T, l *Lab, target string, port int) {
	t.Helper()
	p := startPy(t, l, target, pyUDPEcho, nil, fmt.Sprint(port))
	if s := p.line(t, 10*time.Second); s != "up" {
		t.Fatalf("UDP echo: %q", s)
	}
}

// TestSocketsServerPolicy: the server's host judges a recorded connection
// by the policy too, so a deny rule holds even when the client's host was
// bypassed (here a SYN forged in h2's host namespace, whole and well-formed
// and claiming h2's own container; before, the listener answered it).
func TestSocketsServerPolicy(t *testing.T) {
	l := newLab(t, Config{Name: "tsksrvp", Hosts: 2, ContainersPerHost: 1, Mode: "sockets"})
	ctx := context.Background()
	srv := replacedServer(t, l, pyEcho, "h2/c1")
	cliIP, _ := l.IP("h2/c1")
	if got := optionSYN(t, l, "h2", srv, cliIP, "whole"); got != "synack" {
		t.Fatalf("option SYN before the deny rule: %s, want synack", got)
	}
	rule := policy.Rule{ID: "no-echo", Priority: 10, Action: policy.Deny, Src: netip.PrefixFrom(cliIP, 32),
		Dst: netip.PrefixFrom(srv.Addr(), 32), Proto: policy.TCP, Port: srv.Port()}
	if err := l.PutPolicy(ctx, rule); err != nil {
		t.Fatal(err)
	}
	if _, err := eventually(converges, func() error {
		if p := socketsStatus(t, l, "h1").Policy; p == nil || p.Rules != 1 {
			return fmt.Errorf("h1's fast-path policy %+v, want 1 rule", p)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	denied := counter(t, l, "h1", "syn_denied")
	if got := optionSYN(t, l, "h2", srv, cliIP, "whole"); got != "rst" {
		t.Errorf("option SYN the policy denies: %s, want rst", got)
	}
	if n := counter(t, l, "h1", "syn_denied"); n != denied+1 {
		t.Errorf("h1's syn_denied %d → %d, want +1", denied, n)
	}
	// Another source the rule does not name is still steered.
	if got := optionSYN(t, l, "h2", srv, netip.AddrFrom4([4]byte{cliIP.As4()[0], cliIP.As4()[1], cliIP.As4()[2], 250}), "whole"); got != "synack" {
		t.Errorf("option SYN the policy allows: %s, want synack", got)
	}
}
