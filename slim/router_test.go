package slim

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

var loopback = netip.MustParseAddr("127.0.0.1")

// startRouter runs a router of design on loopback until the test ends.
func startRouter(t *testing.T, design string) Options {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	u, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	relay := u.LocalAddr().(*net.UDPAddr).Port
	u.Close()
	o := Options{Design: design, Socket: filepath.Join(t.TempDir(), design+".sock"), HostIP: loopback, Port: port, RelayPort: relay,
		Lookup: func(a netip.Addr) (netip.Addr, bool) { return loopback, a.Is4() && a.As4()[0] == 10 },
		Log:    slog.New(slog.NewTextHandler(io.Discard, nil))}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, o) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	for range 100 {
		if c, err := net.Dial("unixpacket", o.Socket); err == nil {
			c.Close()
			return o
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("the router never listened")
	return o
}

// call sends req (with fd, when >= 0) on a new connection and returns the
// reply and the fd it carries (-1: none); keep leaves the connection open.
func call(t *testing.T, o Options, req Req, fd int, keep bool) (Rsp, int, *net.UnixConn) {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: o.Socket, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	var oob []byte
	if fd >= 0 {
		oob = syscall.UnixRights(fd)
	}
	if _, _, err := c.WriteMsgUnix(req.Encode(), oob, nil); err != nil {
		t.Fatal(err)
	}
	rsp, got := read(t, c)
	if !keep {
		c.Close()
		c = nil
	}
	r, err := DecodeRsp(rsp)
	if err != nil {
		t.Fatal(err)
	}
	return r, got, c
}

func read(t *testing.T, c *net.UnixConn) ([]byte, int) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	buf, oob := make([]byte, 4096), make([]byte, 64)
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	fd := -1
	if fds := rights(oob[:oobn]); len(fds) > 0 {
		fd = fds[0]
	}
	return buf[:n], fd
}

func fdConn(t *testing.T, fd int) net.Conn {
	t.Helper()
	f := osFile(fd)
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func echoOver(t *testing.T, a, b net.Conn) {
	t.Helper()
	if _, err := a.Write([]byte("slim")); err != nil {
		t.Fatal(err)
	}
	b.SetReadDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(b, buf); err != nil || string(buf) != "slim" {
		t.Fatalf("read %q, %v", buf, err)
	}
}

func TestProtoRoundTrips(t *testing.T) {
	req := Req{Op: OpRegister, Flags: FlagNonblock, Addr: netip.MustParseAddrPort("10.244.1.5:80"), Src: netip.MustParseAddr("10.244.2.7"),
		Arg: -3, Extra: []netip.Addr{netip.MustParseAddr("10.244.1.6")}}
	if b := req.Encode(); len(b) != ReqLen+4 {
		t.Fatalf("request of %d bytes", len(b))
	}
	if got, err := DecodeReq(req.Encode()); err != nil || got.Addr != req.Addr || got.Src != req.Src || got.Arg != -3 || len(got.Extra) != 1 || got.Extra[0] != req.Extra[0] {
		t.Errorf("request round trip: %+v %v", got, err)
	}
	rsp := Rsp{Err: -1, Addr: netip.MustParseAddrPort("10.99.0.1:4000"), List: []netip.AddrPort{netip.MustParseAddrPort("10.244.1.5:80")}}
	if got, err := DecodeRsp(rsp.Encode()); err != nil || got.Addr != rsp.Addr || got.Err != -1 || len(got.List) != 1 || got.List[0] != rsp.List[0] {
		t.Errorf("reply round trip: %+v %v", got, err)
	}
	h := Hdr{Dst: netip.MustParseAddrPort("10.244.1.5:80"), Src: netip.MustParseAddrPort("10.244.2.7:41000")}
	if got, err := DecodeHdr(h.Encode()); err != nil || got != h {
		t.Errorf("header round trip: %+v %v", got, err)
	}
	if _, err := DecodeReq(make([]byte, ReqLen)); err == nil {
		t.Error("a request without the magic was read")
	}
}

// TestSlimFast: a registered listener gets the host connection the
// client's router opened to the router port, past the header, with the
// client's overlay address; a second registration of the address is
// refused, and closing the first frees it.
func TestSlimFast(t *testing.T) {
	o := startRouter(t, DesignSlimFast)
	dst := netip.MustParseAddrPort("10.244.1.5:80")
	rsp, _, reg := call(t, o, Req{Op: OpRegister, Addr: dst}, -1, true)
	if rsp.Err != 0 {
		t.Fatalf("register: errno %d", rsp.Err)
	}
	if rsp, _, _ := call(t, o, Req{Op: OpRegister, Addr: dst}, -1, false); rsp.Err != int32(unix.EADDRINUSE) {
		t.Errorf("a second registration: errno %d, want EADDRINUSE", rsp.Err)
	}
	if rsp, _, _ := call(t, o, Req{Op: OpList}, -1, false); len(rsp.List) != 1 || rsp.List[0] != dst {
		t.Errorf("list %v", rsp.List)
	}
	src := netip.MustParseAddr("10.244.2.7")
	rsp, cfd, _ := call(t, o, Req{Op: OpFConnect, Addr: dst, Src: src}, -1, false)
	if rsp.Err != 0 || cfd < 0 {
		t.Fatalf("fconnect: errno %d, fd %d", rsp.Err, cfd)
	}
	client := fdConn(t, cfd)
	p, sfd := read(t, reg)
	if len(p) != PushLen || sfd < 0 || netip.AddrFrom4([4]byte(p[4:8])) != src {
		t.Fatalf("push % x, fd %d", p, sfd)
	}
	server := fdConn(t, sfd)
	echoOver(t, client, server)
	echoOver(t, server, client)
	if rsp, fd, _ := call(t, o, Req{Op: OpFConnect, Addr: netip.MustParseAddrPort("192.0.2.1:80")}, -1, false); rsp.Err != int32(unix.EHOSTUNREACH) || fd >= 0 {
		t.Errorf("to an address no host holds: errno %d", rsp.Err)
	}
	reg.Close()
	for range 100 {
		if rsp, _, _ := call(t, o, Req{Op: OpList}, -1, false); len(rsp.List) == 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Error("a closed listener's registration stayed")
}

// TestSlim: the router's twin sockets: created in its namespace, bound to
// the host address, connected, accepted.
func TestSlim(t *testing.T) {
	o := startRouter(t, DesignSlim)
	rsp, lfd, _ := call(t, o, Req{Op: OpSocket}, -1, false)
	if rsp.Err != 0 || lfd < 0 {
		t.Fatalf("socket: %d", rsp.Err)
	}
	defer unix.Close(lfd)
	rsp, _, _ = call(t, o, Req{Op: OpBind}, lfd, false)
	if rsp.Err != 0 || rsp.Addr.Addr() != loopback || rsp.Addr.Port() == 0 {
		t.Fatalf("bind: %d %v", rsp.Err, rsp.Addr)
	}
	if err := unix.Listen(lfd, 8); err != nil {
		t.Fatal(err)
	}
	bound := rsp.Addr
	_, cfd, _ := call(t, o, Req{Op: OpSocket}, -1, false)
	if rsp, _, _ := call(t, o, Req{Op: OpConnect, Addr: bound}, cfd, false); rsp.Err != 0 {
		t.Fatalf("connect: %d", rsp.Err)
	}
	rsp, afd, _ := call(t, o, Req{Op: OpAccept}, lfd, false)
	if rsp.Err != 0 || afd < 0 || rsp.Addr.Addr() != loopback {
		t.Fatalf("accept: %d %v", rsp.Err, rsp.Addr)
	}
	client, server := fdConn(t, cfd), fdConn(t, afd)
	echoOver(t, client, server)
	echoOver(t, server, client)
	if rsp, _, _ := call(t, o, Req{Op: OpRegister}, -1, false); rsp.Err != int32(unix.EINVAL) {
		t.Errorf("a SlimFast request to the Slim router: errno %d", rsp.Err)
	}
}

func osFile(fd int) *os.File { return os.NewFile(uintptr(fd), "slim") }

// TestSlimFastUDP: a registered UDP socket gets, through the relay, a
// client's tagged datagram with the client's overlay and host addresses.
func TestSlimFastUDP(t *testing.T) {
	o := startRouter(t, DesignSlimFast)
	srvOv := netip.MustParseAddrPort("10.244.1.5:53")
	rsp, sfd, reg := call(t, o, Req{Op: OpUSocket, Addr: srvOv}, -1, true)
	if rsp.Err != 0 || sfd < 0 || rsp.Relay != uint16(o.RelayPort) || rsp.Addr.Addr() != loopback {
		t.Fatalf("register: errno %d, fd %d, %v relay %d", rsp.Err, sfd, rsp.Addr, rsp.Relay)
	}
	defer reg.Close()
	if rsp, _, _ := call(t, o, Req{Op: OpUSocket, Addr: srvOv}, -1, false); rsp.Err != int32(unix.EADDRINUSE) {
		t.Errorf("a second registration: errno %d", rsp.Err)
	}
	rsp, cfd, _ := call(t, o, Req{Op: OpUSocket}, -1, false)
	if rsp.Err != 0 || cfd < 0 {
		t.Fatalf("client socket: %d", rsp.Err)
	}
	if rsp, _, _ := call(t, o, Req{Op: OpULookup, Addr: srvOv}, -1, false); rsp.Err != 0 || rsp.Addr != netip.AddrPortFrom(loopback, uint16(o.RelayPort)) {
		t.Fatalf("lookup: %d %v", rsp.Err, rsp.Addr)
	}
	cliOv := netip.MustParseAddrPort("10.244.2.7:40000")
	msg := append(Tag{A: srvOv, B: cliOv}.Encode(), "hello"...)
	if err := unix.Sendto(cfd, msg, 0, sockaddr(netip.AddrPortFrom(loopback, uint16(o.RelayPort)))); err != nil {
		t.Fatal(err)
	}
	unix.SetsockoptTimeval(sfd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 3})
	b := make([]byte, 100)
	n, from, err := unix.Recvfrom(sfd, b, 0)
	if err != nil {
		t.Fatal(err)
	}
	tag, ok := DecodeTag(b[:n])
	csa, _ := unix.Getsockname(cfd)
	if !ok || tag.A != cliOv || tag.B != addrPort(csa) || string(b[TagLen:n]) != "hello" || addrPort(from).Port() != uint16(o.RelayPort) {
		t.Errorf("relayed % x from %v, tag %+v", b[:n], addrPort(from), tag)
	}
	unix.Close(sfd)
	unix.Close(cfd)
}
