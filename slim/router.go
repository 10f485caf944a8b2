package slim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Designs.
const (
	DesignSlim     = "slim"
	DesignSlimFast = "slimfast"
)

// Options configure one router.
type Options struct {
	Design string     // DesignSlim or DesignSlimFast
	Socket string     // the Unix socket (SOCK_SEQPACKET) shims reach the router on
	HostIP netip.Addr // this host's underlay address: host sockets bind to it
	Port   int        // SlimFast: the router port of every host (DefaultPort)
	// RelayPort (SlimFast) is every host's UDP relay port (DefaultRelayPort).
	RelayPort int
	// Lookup (SlimFast) names the host an overlay address lives on.
	Lookup func(netip.Addr) (netip.Addr, bool)
	Log    *slog.Logger
}

// waitLimit bounds every wait a request may make (an accept, a header).
const waitLimit = 5 * time.Second

// router serves one design's requests.
type router struct {
	o    Options
	mu   sync.Mutex
	reg  map[netip.AddrPort]*net.UnixConn  // SlimFast: registered listeners
	ureg map[netip.AddrPort]netip.AddrPort // SlimFast: registered UDP sockets' host addresses
}

// Run serves until ctx ends.
func Run(ctx context.Context, o Options) error {
	if o.Design != DesignSlim && o.Design != DesignSlimFast {
		return fmt.Errorf("slim router: design %q, want %s or %s", o.Design, DesignSlim, DesignSlimFast)
	}
	if !o.HostIP.Is4() {
		return fmt.Errorf("slim router: host address %v is not IPv4", o.HostIP)
	}
	if o.Log == nil {
		o.Log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	if o.Port == 0 {
		o.Port = DefaultPort
	}
	if o.RelayPort == 0 {
		o.RelayPort = DefaultRelayPort
	}
	r := &router{o: o, reg: map[netip.AddrPort]*net.UnixConn{}, ureg: map[netip.AddrPort]netip.AddrPort{}}
	os.Remove(o.Socket)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: o.Socket, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("slim router: %w", err)
	}
	defer os.Remove(o.Socket)
	if err := os.Chmod(o.Socket, 0o666); err != nil {
		ln.Close()
		return fmt.Errorf("slim router: %w", err)
	}
	if o.Design == DesignSlimFast {
		stop, err := r.listenHosts()
		if err != nil {
			ln.Close()
			return err
		}
		defer stop()
		relay, err := r.relay()
		if err != nil {
			ln.Close()
			return err
		}
		defer relay.Close()
	}
	go func() { <-ctx.Done(); ln.Close() }()
	o.Log.Info("slim router ready", "design", o.Design, "socket", o.Socket, "host", o.HostIP)
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("slim router: accept: %w", err)
		}
		go r.serve(c)
	}
}

// serve answers one shim connection: one request (a registration keeps
// the connection for as long as the listener lives).
func (r *router) serve(c *net.UnixConn) {
	defer c.Close()
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil || n == 0 {
		return
	}
	fds := rights(oob[:oobn])
	defer closeAll(fds)
	req, err := DecodeReq(buf[:n])
	if err != nil {
		r.o.Log.Warn("slim router: bad request", "err", err)
		return
	}
	fd := -1
	if len(fds) > 0 {
		fd = fds[0]
	}
	var rsp Rsp
	out := -1
	switch {
	case r.o.Design == DesignSlim && req.Op == OpSocket:
		out, rsp.Err = r.socket(req)
	case r.o.Design == DesignSlim && req.Op == OpBind && fd >= 0:
		rsp.Addr, rsp.Err = r.bind(fd)
	case r.o.Design == DesignSlim && req.Op == OpAccept && fd >= 0:
		out, rsp.Addr, rsp.Err = r.accept(fd, req.Flags)
	case r.o.Design == DesignSlim && req.Op == OpConnect && fd >= 0:
		rsp.Err = errnoOf(connectRetrying(fd, sockaddr(req.Addr)))
	case r.o.Design == DesignSlimFast && req.Op == OpRegister:
		r.register(c, req)
		return
	case r.o.Design == DesignSlimFast && req.Op == OpFConnect:
		out, rsp.Err = r.fconnect(req)
	case r.o.Design == DesignSlimFast && req.Op == OpUSocket && req.Addr.IsValid() && req.Addr.Addr().IsValid() && !req.Addr.Addr().IsUnspecified():
		r.uregister(c, req)
		return
	case r.o.Design == DesignSlimFast && req.Op == OpUSocket:
		out, rsp.Addr, rsp.Err = r.usocket()
	case r.o.Design == DesignSlimFast && req.Op == OpULookup:
		if h, ok := r.o.Lookup(req.Addr.Addr()); ok {
			rsp.Addr = netip.AddrPortFrom(h, uint16(r.o.RelayPort))
		} else {
			rsp.Err = int32(unix.EHOSTUNREACH)
		}
	case r.o.Design == DesignSlimFast && req.Op == OpList:
		rsp.List = r.list(req.Flags&FlagUDP != 0)
	default:
		rsp.Err = int32(unix.EINVAL)
	}
	if out >= 0 {
		defer unix.Close(out)
	}
	if err := reply(c, rsp, out); err != nil {
		r.o.Log.Debug("slim router: reply", "err", err)
	}
}

func reply(c *net.UnixConn, rsp Rsp, fd int) error {
	var oob []byte
	if fd >= 0 && rsp.Err == 0 {
		oob = syscall.UnixRights(fd)
	}
	_, _, err := c.WriteMsgUnix(rsp.Encode(), oob, nil)
	return err
}

func rights(oob []byte) []int {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for _, m := range msgs {
		if f, err := syscall.ParseUnixRights(&m); err == nil {
			fds = append(fds, f...)
		}
	}
	return fds
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

func errnoOf(err error) int32 {
	var e unix.Errno
	if err == nil {
		return 0
	}
	if errors.As(err, &e) {
		return int32(e)
	}
	return int32(unix.EIO)
}

func sockaddr(ap netip.AddrPort) *unix.SockaddrInet4 {
	return &unix.SockaddrInet4{Addr: ap.Addr().As4(), Port: int(ap.Port())}
}

func addrPort(sa unix.Sockaddr) netip.AddrPort {
	if s, ok := sa.(*unix.SockaddrInet4); ok {
		return netip.AddrPortFrom(netip.AddrFrom4(s.Addr), uint16(s.Port))
	}
	return netip.AddrPort{}
}

// hostSocket is a TCP socket of this (the host's) namespace.
func hostSocket(flags uint16) (int, error) {
	typ := unix.SOCK_STREAM | unix.SOCK_CLOEXEC
	if flags&FlagNonblock != 0 {
		typ |= unix.SOCK_NONBLOCK
	}
	return unix.Socket(unix.AF_INET, typ, 0)
}

// Slim (§4.1): the twin of a container's socket, in the host's namespace.
func (r *router) socket(req Req) (int, int32) {
	fd, err := hostSocket(req.Flags)
	return fd, errnoOf(err)
}

// bind puts a listening twin on the host address, at a port of the host's
// choosing: the port translation Slim's service discovery then tells clients.
func (r *router) bind(fd int) (netip.AddrPort, int32) {
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: r.o.HostIP.As4()}); err != nil {
		return netip.AddrPort{}, errnoOf(err)
	}
	sa, err := unix.Getsockname(fd)
	return addrPort(sa), errnoOf(err)
}

// accept waits on the host listener for a connection (the router's part of
// a Slim accept).
func (r *router) accept(fd int, flags uint16) (int, netip.AddrPort, int32) {
	deadline := time.Now().Add(waitLimit)
	for time.Now().Before(deadline) {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if _, err := unix.Poll(p, int(time.Until(deadline).Milliseconds())+1); err != nil && err != unix.EINTR {
			return -1, netip.AddrPort{}, errnoOf(err)
		}
		typ := unix.SOCK_CLOEXEC
		if flags&FlagNonblock != 0 {
			typ |= unix.SOCK_NONBLOCK
		}
		nfd, sa, err := unix.Accept4(fd, typ)
		switch {
		case err == nil:
			return nfd, addrPort(sa), 0
		case err == unix.EAGAIN || err == unix.EINTR:
			continue // another accept took it
		default:
			return -1, netip.AddrPort{}, errnoOf(err)
		}
	}
	return -1, netip.AddrPort{}, int32(unix.ETIMEDOUT)
}
