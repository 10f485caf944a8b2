package sockets

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/skiffnet/skiff/policy"
)

// Role of a replaced socket (enum sks_role).
type Role uint8

const (
	Fresh  Role = 1 // handed to a container, not used yet
	Client Role = 2
	Listen Role = 3
	Child  Role = 4 // accepted
)

func (r Role) String() string {
	switch r {
	case Fresh:
		return "fresh"
	case Client:
		return "client"
	case Listen:
		return "listen"
	case Child:
		return "accepted"
	}
	return fmt.Sprintf("role(%d)", uint8(r))
}

// tcpListen is the kernel's TCP_LISTEN state.
const tcpListen = 10

// Conn is a replaced socket as the socket iterator sees it, in overlay
// terms. Ports of zero mean "the socket's real port".
type Conn struct {
	Cookie uint64
	Role   Role
	State  uint8
	Local  netip.AddrPort
	Peer   netip.AddrPort
}

// Flow returns the connection as the policy judges it: from the side that
// connected to the listener's address and port.
func (c Conn) Flow() policy.Flow {
	if c.Role == Child {
		return policy.Flow{Src: c.Peer.Addr(), Dst: c.Local.Addr(), Proto: policy.TCP, Port: c.Local.Port()}
	}
	dst := c.Peer.Addr()
	if dst.IsLoopback() {
		dst = c.Local.Addr()
	}
	return policy.Flow{Src: c.Local.Addr(), Dst: dst, Proto: policy.TCP, Port: c.Peer.Port()}
}

// Conns lists the host's replaced sockets. The TCP iterator walks the
// namespace of the process creating it: the agent's, the host's.
func (l *Layer) Conns() ([]Conn, error) {
	data, err := runIter(l.objs.SksDump)
	if err != nil {
		return nil, err
	}
	var out []Conn
	r := bytes.NewReader(data)
	for {
		var s sksSksSock
		if err := binary.Read(r, binary.NativeEndian, &s); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, fmt.Errorf("socket dump: %w", err)
		}
		out = append(out, Conn{
			Cookie: s.Cookie, Role: Role(s.Role), State: s.State,
			Local: netip.AddrPortFrom(addrOf(s.LocalIp), s.LocalPort),
			Peer:  netip.AddrPortFrom(addrOf(s.PeerIp), s.PeerPort),
		})
	}
}

func runIter(prog *ebpf.Program) ([]byte, error) {
	it, err := link.AttachIter(link.IterOptions{Program: prog})
	if err != nil {
		return nil, fmt.Errorf("socket iterator: %w", err)
	}
	defer it.Close()
	rd, err := it.Open()
	if err != nil {
		return nil, fmt.Errorf("socket iterator: %w", err)
	}
	defer rd.Close()
	return io.ReadAll(rd)
}

// Destroy ends the given sockets (bpf_sock_destroy: the application's next
// call fails with ECONNABORTED, the peer gets a RST).
func (l *Layer) Destroy(cookies []uint64) error {
	if len(cookies) == 0 {
		return nil
	}
	var errs []error
	for _, c := range cookies {
		errs = append(errs, l.objs.SksKill.Put(c, uint8(1)))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("mark sockets to end: %w", err)
	}
	_, err := runIter(l.objs.SksDestroy)
	for _, c := range cookies {
		l.objs.SksKill.Delete(c)
	}
	return err
}

// evExposed is SKS_EV_EXPOSED: sockops saw a listener that was never bound.
const evExposed = 3

// exposed reports a listener a container made without binding: listen()
// autobinds it to a host port, where no hook can move it to loopback (the
// shim never does this; a program bypassing it can).
func (c Conn) exposed() bool { return c.Role == Fresh && c.State == tcpListen }

// endExposed ends exposed listeners.
func (l *Layer) endExposed() (int, error) {
	return l.end(func(c Conn) bool { return c.exposed() })
}

// Enforce ends replaced connections rules no longer allow, and exposed
// listeners. It returns how many it ended.
func (l *Layer) Enforce(rules policy.Set) (int, error) {
	return l.end(func(c Conn) bool {
		if c.exposed() {
			return true
		}
		known := c.Peer.Addr().IsValid() && !c.Peer.Addr().IsUnspecified()
		return (c.Role == Client || c.Role == Child) && known && !rules.Allowed(c.Flow())
	})
}

// end destroys the replaced sockets kill selects.
func (l *Layer) end(kill func(Conn) bool) (int, error) {
	conns, err := l.Conns()
	if err != nil {
		return 0, err
	}
	var cookies []uint64
	for _, c := range conns {
		if kill(c) {
			cookies = append(cookies, c.Cookie)
		}
	}
	return len(cookies), l.Destroy(cookies)
}
