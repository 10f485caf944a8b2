package slim

import (
	"io"
	"net"
	"net/netip"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// SlimFast (§III-B, Fig. 7): the socket mapping table, the router port,
// and the client's connect.

// register puts a listener's addresses in the table for as long as its
// connection (dup'ed over the application's listening socket) lives.
func (r *router) register(c *net.UnixConn, req Req) {
	hold(r, r.reg, req, c, c, Rsp{}, -1)
}

// hold enters req's addresses (its address, and its extra addresses at its
// port) into m with v, replies ok (with fd) on c, and removes them when c
// ends (every process holding it closed it); an address m holds already
// gets EADDRINUSE.
func hold[V comparable](r *router, m map[netip.AddrPort]V, req Req, v V, c *net.UnixConn, ok Rsp, fd int) {
	keys := []netip.AddrPort{req.Addr}
	for _, a := range req.Extra {
		keys = append(keys, netip.AddrPortFrom(a, req.Addr.Port()))
	}
	r.mu.Lock()
	taken := slices.ContainsFunc(keys, func(k netip.AddrPort) bool { _, in := m[k]; return in })
	if !taken {
		for _, k := range keys {
			m[k] = v
		}
	}
	r.mu.Unlock()
	if taken {
		reply(c, Rsp{Err: int32(unix.EADDRINUSE)}, -1)
		return
	}
	defer func() {
		r.mu.Lock()
		for _, k := range keys {
			if m[k] == v {
				delete(m, k)
			}
		}
		r.mu.Unlock()
	}()
	if reply(c, ok, fd) != nil {
		return
	}
	b := make([]byte, 64)
	for {
		if _, err := c.Read(b); err != nil {
			return
		}
	}
}

func (r *router) list(udp bool) []netip.AddrPort {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []netip.AddrPort
	for k := range r.reg {
		if !udp {
			out = append(out, k)
		}
	}
	for k := range r.ureg {
		if udp {
			out = append(out, k)
		}
	}
	slices.SortFunc(out, func(a, b netip.AddrPort) int { return a.Compare(b) })
	return out
}

// fconnect opens the client's host connection: to the router port of the
// host the destination lives on, the header first.
func (r *router) fconnect(req Req) (int, int32) {
	host, ok := r.o.Lookup(req.Addr.Addr())
	if !ok {
		return -1, int32(unix.EHOSTUNREACH)
	}
	fd, err := hostSocket(0)
	if err != nil {
		return -1, errnoOf(err)
	}
	tv := unix.NsecToTimeval(int64(3 * time.Second))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv) // bounds the connect
	if err := connectRetrying(fd, sockaddr(netip.AddrPortFrom(host, uint16(r.o.Port)))); err != nil {
		unix.Close(fd)
		return -1, errnoOf(err)
	}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &unix.Timeval{})
	sa, _ := unix.Getsockname(fd)
	hdr := Hdr{Dst: req.Addr, Src: netip.AddrPortFrom(req.Src, addrPort(sa).Port())}.Encode()
	n, err := unix.Write(fd, hdr)
	for err == unix.EINTR {
		n, err = unix.Write(fd, hdr)
	}
	if err != nil || n != HdrLen {
		unix.Close(fd)
		return -1, int32(unix.EIO)
	}
	return fd, 0
}

// listenHosts serves the router port: each connection's header names a
// registered listener, which gets the connection's fd.
func (r *router) listenHosts() (func(), error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	if err := unix.Bind(fd, sockaddr(netip.AddrPortFrom(r.o.HostIP, uint16(r.o.Port)))); err != nil {
		unix.Close(fd)
		return nil, err
	}
	if err := unix.Listen(fd, 4096); err != nil {
		unix.Close(fd)
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			nfd, _, err := unix.Accept4(fd, unix.SOCK_CLOEXEC)
			if err == unix.EINTR || err == unix.ECONNABORTED {
				continue
			}
			if err != nil {
				return
			}
			go r.serveHost(nfd)
		}
	}()
	return func() { unix.Shutdown(fd, unix.SHUT_RDWR); unix.Close(fd); <-done }, nil
}

func (r *router) serveHost(fd int) {
	defer unix.Close(fd)
	b, err := readHeader(fd)
	if err != nil {
		r.o.Log.Warn("slim router: no header", "err", err)
		return
	}
	h, err := DecodeHdr(b)
	if err != nil {
		r.o.Log.Warn("slim router: bad header", "err", err)
		return
	}
	r.mu.Lock()
	c := r.reg[h.Dst]
	r.mu.Unlock()
	if c == nil {
		r.o.Log.Warn("slim router: nothing listens", "dst", h.Dst)
		return // the client reads EOF
	}
	if _, _, err := c.WriteMsgUnix(push(h.Src), unix.UnixRights(fd), nil); err != nil {
		r.o.Log.Warn("slim router: push", "dst", h.Dst, "err", err)
	}
}

// readHeader reads a connection's header within waitLimit. A signal (the
// Go runtime preempts threads with SIGURG) interrupts blocking calls:
// they are retried, never taken for the peer's silence.
func readHeader(fd int) ([]byte, error) {
	b := make([]byte, HdrLen)
	deadline := time.Now().Add(waitLimit)
	for got := 0; got < HdrLen; {
		left := time.Until(deadline)
		if left <= 0 {
			return nil, unix.ETIMEDOUT
		}
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if _, err := unix.Poll(p, int(left.Milliseconds())+1); err == unix.EINTR {
			continue
		} else if err != nil {
			return nil, err
		}
		n, _, err := unix.Recvfrom(fd, b[got:], unix.MSG_DONTWAIT)
		switch {
		case err == unix.EINTR || err == unix.EAGAIN:
		case err != nil:
			return nil, err
		case n == 0:
			return nil, io.ErrUnexpectedEOF
		default:
			got += n
		}
	}
	return b, nil
}

// connectRetrying connects a blocking socket; a connect a signal
// interrupted goes on in the kernel, so it is waited for, not started again.
func connectRetrying(fd int, sa unix.Sockaddr) error {
	err := unix.Connect(fd, sa)
	if err != unix.EINTR {
		return err
	}
	p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
	for {
		if _, err := unix.Poll(p, int(waitLimit.Milliseconds())); err == unix.EINTR {
			continue
		} else if err != nil {
			return err
		}
		v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			return err
		}
		if v != 0 {
			return unix.Errno(v)
		}
		return nil
	}
}
