package sockets

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"

	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
)

// tcpListen is the kernel's TCP_LISTEN state.
const tcpListen = 10

// conn is a replaced socket as the socket iterator sees it, in overlay
// terms. Ports of zero mean "the socket's real port".
type conn struct {
	Cookie uint64
	Role   sksSksRole
	State  uint8
	Local  netip.AddrPort
	Peer   netip.AddrPort
}

// flow returns the connection as the policy judges it: from the side that
// connected to the listener's address and port.
func (c conn) flow() policy.Flow {
	if c.Role == sksSksRoleSKS_CHILD {
		return policy.Flow{Src: c.Peer.Addr(), Dst: c.Local.Addr(), Proto: policy.TCP, Port: c.Local.Port()}
	}
	dst := c.Peer.Addr()
	if dst.IsLoopback() {
		dst = c.Local.Addr()
	}
	return policy.Flow{Src: c.Local.Addr(), Dst: dst, Proto: policy.TCP, Port: c.Peer.Port()}
}

// conns lists the host's replaced sockets. The TCP iterator walks the
// namespace of the process creating it: the agent's, the host's.
func (l *dataPlane) conns() ([]conn, error) {
	data, err := bpfmap.Iterate(l.objs.SksDump)
	if err != nil {
		return nil, err
	}
	var out []conn
	r := bytes.NewReader(data)
	for {
		var s sksSksSock
		if err := binary.Read(r, binary.NativeEndian, &s); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, fmt.Errorf("socket dump: %w", err)
		}
		out = append(out, conn{
			Cookie: s.Cookie, Role: sksSksRole(s.Role), State: s.State,
			Local: netip.AddrPortFrom(bpfmap.Addr(s.LocalIp), s.LocalPort),
			Peer:  netip.AddrPortFrom(bpfmap.Addr(s.PeerIp), s.PeerPort),
		})
	}
}

// destroy ends the given sockets (bpf_sock_destroy: the application's next
// call fails with ECONNABORTED, the peer gets a RST).
func (l *dataPlane) destroy(cookies []uint64) error {
	return l.destroyBatches(cookies, int(l.objs.SksKill.MaxEntries()))
}

// destroyBatches marks the sockets to end in sks_kill, at most batch at a
// time, and runs the destroying iterator over the host's sockets once per
// batch: a policy change may end more connections than the map holds.
func (l *dataPlane) destroyBatches(cookies []uint64, batch int) error {
	for len(cookies) > 0 {
		n := min(len(cookies), batch)
		if err := l.destroyMarked(cookies[:n]); err != nil {
			return err
		}
		cookies = cookies[n:]
	}
	return nil
}

func (l *dataPlane) destroyMarked(cookies []uint64) error {
	marks := make([]uint8, len(cookies))
	for i := range marks {
		marks[i] = 1
	}
	if _, err := l.objs.SksKill.BatchUpdate(cookies, marks, nil); err != nil {
		return fmt.Errorf("mark sockets to end: %w", err)
	}
	_, err := bpfmap.Iterate(l.objs.SksDestroy)
	if _, derr := bpfmap.Delete(l.objs.SksKill, cookies); derr != nil {
		err = errors.Join(err, fmt.Errorf("unmark sockets: %w", derr))
	}
	return err
}

// exposed reports a listener a container made without binding, and what
// it accepted: listen() autobinds it to a host address, where no hook can
// move it to loopback (the shim never does this; a program bypassing it
// can, after a failed or undone connect too). sockops marks them; the
// state test catches those an earlier version's programs did not mark.
func (c conn) exposed() bool {
	return c.Role == sksSksRoleSKS_EXPOSED || (c.State == tcpListen && c.Role != sksSksRoleSKS_LISTEN)
}

// endExposed ends exposed listeners.
func (l *dataPlane) endExposed() (int, error) {
	return l.end(func(c conn) bool { return c.exposed() })
}

// Enforce ends replaced connections rules no longer allow, and exposed
// listeners. It returns how many it ended.
func (l *dataPlane) Enforce(rules policy.Set) (int, error) {
	return l.end(func(c conn) bool { return c.exposed() || l.denied(rules, c) })
}

// denied says whether rules end c, a replaced connection. A peer that
// cannot be known is left alone, and so is a host's own address: a
// connection from the host stack (a kubelet probe, steered by to_container),
// which the overlay's policy does not judge either.
func (l *dataPlane) denied(rules policy.Set, c conn) bool {
	if c.Role != sksSksRoleSKS_CLIENT && c.Role != sksSksRoleSKS_CHILD {
		return false
	}
	p := c.Peer.Addr()
	if !p.IsValid() || p.IsUnspecified() || l.hostAddress(p) {
		return false
	}
	return !rules.Allowed(c.flow())
}

// hostAddress says whether a is a host's own address in the cluster: its
// VXLAN device's or its bridge's.
func (l *dataPlane) hostAddress(a netip.Addr) bool {
	if !l.cfg.Cluster.CIDR.Contains(a) {
		return false
	}
	subnet := netip.PrefixFrom(a, l.cfg.Cluster.HostPrefix)
	return a == cluster.VTEPAddr(subnet) || a == cluster.Gateway(subnet)
}

// end destroys the replaced sockets kill selects.
func (l *dataPlane) end(kill func(conn) bool) (int, error) {
	conns, err := l.conns()
	if err != nil {
		return 0, err
	}
	var cookies []uint64
	for _, c := range conns {
		if kill(c) {
			cookies = append(cookies, c.Cookie)
		}
	}
	return len(cookies), l.destroy(cookies)
}
