package slim

import (
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// SlimFast's UDP (§III-C, Fig. 8b/c): a server's socket is a host UDP
// socket the router registered under its overlay address; a client's
// first datagrams go to the server host's relay with a tag naming both
// ends, the relay hands them on to the server's socket, and the server's
// tagged reply tells the client where to send directly from then on.

// usocket is a host UDP socket bound to the host address.
func (r *router) usocket() (int, netip.AddrPort, int32) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, netip.AddrPort{}, errnoOf(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: r.o.HostIP.As4()}); err != nil {
		unix.Close(fd)
		return -1, netip.AddrPort{}, errnoOf(err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		unix.Close(fd)
		return -1, netip.AddrPort{}, errnoOf(err)
	}
	return fd, addrPort(sa), 0
}

// uregister gives a server's UDP socket a host twin and registers it under
// its overlay addresses for as long as the connection lives.
func (r *router) uregister(c *net.UnixConn, req Req) {
	fd, host, errno := r.usocket()
	if errno != 0 {
		reply(c, Rsp{Err: errno}, -1)
		return
	}
	defer unix.Close(fd)
	hold(r, r.ureg, req, host, c, Rsp{Addr: host, Relay: uint16(r.o.RelayPort)}, fd)
}

// relay serves the UDP relay port: a tagged datagram for a registered
// socket goes on to it, tagged with the client's overlay and host
// addresses.
func (r *router) relay() (*net.UDPConn, error) {
	c, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(r.o.HostIP, uint16(r.o.RelayPort))))
	if err != nil {
		return nil, err
	}
	go func() {
		b := make([]byte, 65536)
		for {
			n, src, err := c.ReadFromUDPAddrPort(b)
			if err != nil {
				return
			}
			tag, ok := DecodeTag(b[:n])
			if !ok {
				continue
			}
			r.mu.Lock()
			dst, ok := r.ureg[tag.A]
			r.mu.Unlock()
			if !ok {
				continue // nothing there: a datagram to a closed port is lost
			}
			copy(b, Tag{A: tag.B, B: src}.Encode())
			c.WriteToUDPAddrPort(b[:n], dst)
		}
	}()
	return c, nil
}
