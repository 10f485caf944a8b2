package sockets

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/iptables"
	"github.com/skiffnet/skiff/limits"
	"github.com/skiffnet/skiff/netlinksafe"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/sockets/broker"
	"github.com/skiffnet/skiff/tc"
)

// filterName tags the layer's tc filters.
const filterName = "skiff-sockets"

// linkDir holds the pinned links: the host's sk_lookup link and each container's cgroup links, so programs stay attached without the
// agent.
func (l *dataPlane) linkDir() string { return filepath.Join(l.cfg.PinDir, "sks_links") }

// Setup attaches the host-wide programs — the SYN recorder on the
// underlay's ingress (same-host connections are recorded by their
// clients), the overlay steering on the VXLAN device, sk_lookup on the
// host namespace — and routes steered overlay packets to the host stack
// (JudgeInput puts them through the overlay's policy), past a second
// conntrack pass for the ones turned back on a container's veth
// (notrackRule).
func (l *dataPlane) Setup() error {
	if err := os.MkdirAll(l.linkDir(), 0o700); err != nil {
		return fmt.Errorf("link pins: %w", err)
	}
	h := &netlink.Handle{}
	if err := l.attachRecorder(h); err != nil {
		return err
	}
	vx, err := netlink.LinkByName(overlay.VXLANName)
	if err != nil {
		return fmt.Errorf("%s: %w", overlay.VXLANName, err)
	}
	if err := tc.Attach(h, vx, tc.Ingress, tc.PrioSockets, filterName, l.objs.SksFromOverlay); err != nil {
		return err
	}
	br, err := netlink.LinkByName(overlay.BridgeName)
	if err != nil {
		return fmt.Errorf("%s: %w", overlay.BridgeName, err)
	}
	// An earlier skiff's steering on the bridge (to_container on each
	// container's veth does it now).
	if err := tc.Detach(h, br, tc.Egress, filterName); err != nil {
		return err
	}
	// to_container turns the host's packets back into lo; their source is
	// the host's own bridge address, which lo must then accept.
	if err := acceptLocal(l.cfg.StateDir); err != nil {
		return err
	}
	if err := hostStackRoute(l.cfg.Host.Subnet); err != nil {
		return err
	}
	if err := iptables.Insert("raw", "PREROUTING", notrackRule...); err != nil {
		return err
	}
	ns, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return fmt.Errorf("host namespace: %w", err)
	}
	defer ns.Close()
	if err := l.pinnedLink("lookup", l.objs.SksLookup, func() (link.Link, error) {
		return link.AttachNetNs(int(ns.Fd()), l.objs.SksLookup)
	}); err != nil {
		return err
	}
	return l.seedServed()
}

// seedServed marks the containers that hold replaced listeners or
// connections accepted from one as served (sks_served), as sockops does when
// a listener is published: after an upgrade from a version without the
// map, their overlay connections would otherwise reach the container.
func (l *dataPlane) seedServed() error {
	conns, err := l.conns()
	if err != nil {
		return err
	}
	for _, c := range conns {
		if c.Role != sksSksRoleSKS_LISTEN && c.Role != sksSksRoleSKS_CHILD {
			continue
		}
		if err := l.objs.SksServed.Update(bpfmap.IPv4(c.Local.Addr()), uint8(1), ebpf.UpdateAny); err != nil {
			return fmt.Errorf("mark %s served: %w", c.Local.Addr(), err)
		}
	}
	return nil
}

// attachRecorder puts the SYN recorder on the underlay's ingress, before
// every other layer's program there (tc.PrioRecorder); it passes every
// packet on (TC_ACT_UNSPEC) but the SYNs it drops, so the device's later
// programs, skiff's and the host's own, still see them. The TCX link of an
// earlier skiff's recorder goes (unpinning it detaches it).
func (l *dataPlane) attachRecorder(h *netlink.Handle) error {
	if err := tc.Attach(h, l.underlay, tc.Ingress, tc.PrioRecorder, filterName, l.objs.SksFromUnderlay); err != nil {
		return err
	}
	old, _ := filepath.Glob(filepath.Join(l.linkDir(), "underlay-*"))
	for _, p := range old {
		if err := os.Remove(p); err != nil {
			return fmt.Errorf("recorder link of an earlier skiff: %w", err)
		}
	}
	return nil
}

// acceptLocalLo lets lo take packets whose source is a local address. Only
// packets a program redirects into lo are looked up by source: the kernel's
// own loopback traffic keeps its route.
const acceptLocalLo = "/proc/sys/net/ipv4/conf/lo/accept_local"

// savedAcceptLocal keeps lo's accept_local as the layer found it, for
// Teardown.
func savedAcceptLocal(stateDir string) string { return filepath.Join(stateDir, "lo-accept-local") }

// acceptLocal turns on acceptLocalLo, first saving the value it had unless
// an earlier start of the layer saved it already.
func acceptLocal(stateDir string) error {
	saved := savedAcceptLocal(stateDir)
	if _, err := os.Stat(saved); errors.Is(err, os.ErrNotExist) {
		v, err := os.ReadFile(acceptLocalLo)
		if err != nil {
			return fmt.Errorf("accept local sources on lo: %w", err)
		}
		if err := os.MkdirAll(stateDir, 0o700); err != nil {
			return fmt.Errorf("state directory: %w", err)
		}
		if err := os.WriteFile(saved, v, 0o600); err != nil {
			return fmt.Errorf("save lo's accept_local: %w", err)
		}
	}
	if err := os.WriteFile(acceptLocalLo, []byte("1"), 0o644); err != nil {
		return fmt.Errorf("accept local sources on lo: %w", err)
	}
	return nil
}

// restoreAcceptLocal gives acceptLocalLo back the value acceptLocal saved.
// Without a saved value (the layer never started) it is left as it is.
func restoreAcceptLocal(stateDir string) error {
	saved := savedAcceptLocal(stateDir)
	v, err := os.ReadFile(saved)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("lo's saved accept_local: %w", err)
	}
	if err := os.WriteFile(acceptLocalLo, v, 0o644); err != nil {
		return fmt.Errorf("restore lo's accept_local: %w", err)
	}
	return os.Remove(saved)
}

// JudgeInput has the overlay's policy judge the overlay packets the layer
// delivers to the host stack (on INPUT; they pass no FORWARD) while the
// policy has rules. With none there is nothing to judge, and the host's
// INPUT chain stays empty: iptables then runs no hook there for any of the
// host's packets.
func (l *dataPlane) JudgeInput(policy bool) error {
	if !policy {
		overlay.UnjudgeInput(Mark)
		return nil
	}
	return overlay.JudgeInput(Mark)
}

// HostStackTOS takes overlay packets for replaced listeners to the host
// stack: the programs set these TOS bits, and a local route for the host's
// subnet with this TOS matches them. The kernel compares a route's TOS
// under its legacy mask (0x1c), and no standard DSCP has all three bits
// (xxx111). A route rather than a rule for skb->mark: once a network
// namespace has a routing rule of its own, every route lookup of the host
// goes through the rule list (docs/sockets.md).
const HostStackTOS = 0x1c

// SameHostAddr is both ends of a same-host fast connection: connect4 binds
// the client to it and sends the connection to it, on lo. sks_lookup gives
// a segment to it the replaced listener its client recorded, or refuses
// it; no host socket ever takes one, whatever listens on every address.
var SameHostAddr = netip.MustParseAddr("127.77.0.1")

// hostStackRoute installs the local route for steered packets and removes
// the ones for an earlier subnet.
func hostStackRoute(subnet netip.Prefix) error {
	dst := &net.IPNet{IP: subnet.Masked().Addr().AsSlice(), Mask: net.CIDRMask(subnet.Bits(), 32)}
	rt := &netlink.Route{LinkIndex: loopbackIndex, Dst: dst, Table: unix.RT_TABLE_LOCAL,
		Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST, Tos: HostStackTOS}
	if err := netlink.RouteReplace(rt); err != nil {
		return fmt.Errorf("local route for TOS %#x: %w", HostStackTOS, err)
	}
	removeHostStackRoutes(subnet)
	return nil
}

// loopbackIndex is lo's interface index in every network namespace.
const loopbackIndex = 1

// removeHostStackRoutes removes the local routes for steered packets,
// except the one for keep.
func removeHostStackRoutes(keep netip.Prefix) {
	filter := &netlink.Route{Table: unix.RT_TABLE_LOCAL, Tos: HostStackTOS}
	routes, err := netlinksafe.Dump(func() ([]netlink.Route, error) {
		return netlink.RouteListFiltered(unix.AF_INET, filter, netlink.RT_FILTER_TABLE|netlink.RT_FILTER_TOS)
	})
	if err != nil {
		return
	}
	for _, r := range routes {
		if r.Type != unix.RTN_LOCAL || r.LinkIndex != loopbackIndex || r.Dst == nil {
			continue
		}
		if p, ok := netip.AddrFromSlice(r.Dst.IP); ok {
			ones, _ := r.Dst.Mask.Size()
			if netip.PrefixFrom(p.Unmap(), ones) == keep {
				continue
			}
		}
		netlink.RouteDel(&r)
	}
}

// pinnedLink makes the link pinned as name run prog: an existing pin (an
// earlier run) is updated in place, so the hook never goes without a
// program; otherwise attach creates the link and it is pinned.
func (l *dataPlane) pinnedLink(name string, prog *ebpf.Program, attach func() (link.Link, error)) error {
	return bpffs.PinLink(filepath.Join(l.linkDir(), name), prog, attach)
}

// cgroupPrograms are the programs attached to each container's cgroup.
func (l *dataPlane) cgroupPrograms() map[string]limits.Program {
	o := &l.objs
	return map[string]limits.Program{
		"sock_create":  {Prog: o.SksSockCreate, Attach: ebpf.AttachCGroupInetSockCreate},
		"sock_release": {Prog: o.SksSockRelease, Attach: ebpf.AttachCgroupInetSockRelease},
		"connect4":     {Prog: o.SksConnect4, Attach: ebpf.AttachCGroupInet4Connect},
		"bind4":        {Prog: o.SksBind4, Attach: ebpf.AttachCGroupInet4Bind},
		"getsockname4": {Prog: o.SksGetsockname4, Attach: ebpf.AttachCgroupInet4GetSockname},
		"getpeername4": {Prog: o.SksGetpeername4, Attach: ebpf.AttachCgroupInet4GetPeername},
		"setsockopt":   {Prog: o.SksSetsockopt, Attach: ebpf.AttachCGroupSetsockopt},
		"getsockopt":   {Prog: o.SksGetsockopt, Attach: ebpf.AttachCGroupGetsockopt},
		"sockops":      {Prog: o.SksSockops, Attach: ebpf.AttachCGroupSockOps},
	}
}

// attachCgroup attaches progs to the cgroup id (directory dir), each with
// a link pinned under its name.
func (l *dataPlane) attachCgroup(id uint64, dir string, progs map[string]limits.Program) error {
	for name, p := range progs {
		err := l.pinnedLink(filepath.Join(cgroupLinks(id), name), p.Prog, func() (link.Link, error) {
			return link.AttachCgroup(link.CgroupOptions{Path: dir, Attach: p.Attach, Program: p.Prog})
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// replaced reports whether e gets host sockets: it needs a cgroup (the
// runtime passes it through the CNI cgroupPath capability).
func replaced(e cluster.Endpoint) bool { return e.Cgroup != "" }

// AddEndpoint gives a local container host sockets: the layer's programs
// on its cgroup, its overlay address keyed by the cgroup, and its broker.
// It is idempotent. Containers without a cgroup stay on the overlay. Every
// container's veth gets the steering both ways: from_container for what
// it sends to a replaced listener, to_container for what reaches it for
// one of its own replaced listeners without having been steered (the
// host's own packets, DNATed ones).
func (l *dataPlane) AddEndpoint(e cluster.Endpoint) error {
	// Every local container, replaced or not, reaches replaced listeners
	// through the overlay as well.
	veth, err := netlink.LinkByName(e.Veth)
	if err != nil {
		return fmt.Errorf("host veth %s: %w", e.Veth, err)
	}
	h := &netlink.Handle{}
	if err := tc.Attach(h, veth, tc.Ingress, tc.PrioSockets, filterName, l.objs.SksFromContainer); err != nil {
		return err
	}
	if err := tc.Attach(h, veth, tc.Egress, tc.PrioSockets, filterName, l.objs.SksToContainer); err != nil {
		return err
	}
	if !replaced(e) {
		return nil
	}
	dir, err := cgroup.Dir(l.cfg.CgroupRoot, e)
	if err != nil {
		return err
	}
	id, err := cgroup.ID(dir)
	if err != nil {
		return err
	}
	if err := l.objs.SksContainers.Put(id, sksSksContainer{Ip: bpfmap.IPv4(e.IP.Addr())}); err != nil {
		return fmt.Errorf("register %s: %w", e.ContainerID, err)
	}
	if err := os.MkdirAll(filepath.Join(l.linkDir(), cgroupLinks(id)), 0o700); err != nil {
		return fmt.Errorf("link pins: %w", err)
	}
	// The limit first: host sockets never run without it.
	if err := l.limit(id, dir, e.Limit); err != nil {
		return fmt.Errorf("container %s: %w", e.ContainerID, err)
	}
	if err := l.attachCgroup(id, dir, l.cgroupPrograms()); err != nil {
		return fmt.Errorf("container %s: %w", e.ContainerID, err)
	}
	return l.brokers.Ensure(e, dir)
}

// limit puts a container's rate limit and QoS class on its host sockets,
// which skip the veth and its qdiscs (limits.Cgroups: token buckets on its
// cgroup, its connections paced and marked), or takes lifted ones off.
func (l *dataPlane) limit(id uint64, dir string, lim cluster.Limit) error {
	if lim.None() && !lim.Marks() {
		if _, err := os.Stat(filepath.Join(l.linkDir(), cgroupLinks(id), "skl_egress")); err != nil {
			return nil // never limited
		}
		err := l.limits.Set(id, lim) // unpaces its connections first
		for name := range l.limits.Programs() {
			err = errors.Join(err, os.Remove(filepath.Join(l.linkDir(), cgroupLinks(id), name)))
		}
		return err
	}
	if err := l.attachCgroup(id, dir, l.limits.Programs()); err != nil {
		return err
	}
	return l.limits.Set(id, lim)
}

// RemoveEndpoint takes a container's programs off its cgroup, stops its
// broker and ends the host sockets that carry its address: the address goes
// back to IPAM, and a listener that outlived the container (passed to a
// process elsewhere) would take connections meant for the next container
// given it, as a connection would keep its identity.
func (l *dataPlane) RemoveEndpoint(e cluster.Endpoint) error {
	l.brokers.Stop(e.ContainerID)
	ip := e.IP.Addr()
	_, err := l.end(func(c conn) bool { return c.Local.Addr() == ip })
	if err != nil {
		err = fmt.Errorf("end the sockets of %s: %w", ip, err)
	}
	dir, gone := cgroup.Dir(l.cfg.CgroupRoot, e)
	var id uint64
	if gone == nil {
		id, gone = cgroup.ID(dir)
	}
	if gone != nil {
		// The cgroup is gone, and its links with it (PruneEndpoints
		// unpins them): the address is forgotten all the same.
		return errors.Join(err, l.forgetAddress(ip))
	}
	err = errors.Join(err, l.unpinCgroup(id))
	releaseCgroup(e, dir)
	return err
}

// releaseCgroup removes a container's cgroup that its broker kept the
// runtime from removing: a runtime that deletes the container's cgroup
// before it runs CNI DEL (runc with cgroupfs, as ctr and podman drive it)
// found the broker still in it and left it. Only an empty cgroup goes
// (rmdir refuses one with processes or children: the runtime removes
// those itself, and gets ENOENT, which runc takes for done, for one
// removed here). A cgroup of the systemd driver is systemd's: the scope
// goes when it empties, which the broker's exit lets it.
func releaseCgroup(e cluster.Endpoint, dir string) {
	if _, systemd := cgroup.SystemdPath(e.Cgroup); systemd {
		return
	}
	unix.Rmdir(dir)
}

// forgetAddress forgets the containers at ip, whose cgroups are gone, and
// the address's ports (forgetPorts).
func (l *dataPlane) forgetAddress(ip netip.Addr) error {
	all, err := bpfmap.Entries[uint64, sksSksContainer](l.objs.SksContainers)
	if err != nil {
		return err
	}
	var gone []uint64
	for id, c := range all {
		if c.Ip == bpfmap.IPv4(ip) {
			gone = append(gone, id)
		}
	}
	if _, err := bpfmap.Delete(l.objs.SksContainers, gone); err != nil {
		return err
	}
	return l.forgetPorts(bpfmap.IPv4(ip))
}

// Held is how many ports the host sockets of the container at ip hold
// (bound or listening), against its quota.
func (l *dataPlane) Held(ip netip.Addr) int {
	var n uint32
	if err := l.objs.SksHeld.Lookup(bpfmap.IPv4(ip), &n); err != nil {
		return 0
	}
	return int(n)
}

// forgetPorts forgets that an address had a replaced listener, the ports
// its sockets held bound and their count.
func (l *dataPlane) forgetPorts(ip uint32) error {
	for _, m := range []*ebpf.Map{l.objs.SksServed, l.objs.SksHeld} {
		if err := m.Delete(ip); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	bound, err := bpfmap.Entries[sksSksKey, uint64](l.objs.SksBound)
	if err != nil {
		return err
	}
	var held []sksSksKey
	for k := range bound {
		if k.Ip == ip {
			held = append(held, k)
		}
	}
	_, err = bpfmap.Delete(l.objs.SksBound, held)
	return err
}

// unpinCgroup detaches the programs from cgroup id and forgets it (its
// limits too), and its address unless another container has it now.
func (l *dataPlane) unpinCgroup(id uint64) error {
	err := errors.Join(os.RemoveAll(filepath.Join(l.linkDir(), cgroupLinks(id))), l.limits.Forget(id))
	var c sksSksContainer
	if lerr := l.objs.SksContainers.Lookup(id, &c); lerr != nil {
		if !errors.Is(lerr, ebpf.ErrKeyNotExist) {
			err = errors.Join(err, lerr)
		}
		return err
	}
	if derr := l.objs.SksContainers.Delete(id); derr != nil && !errors.Is(derr, ebpf.ErrKeyNotExist) {
		return errors.Join(err, derr)
	}
	all, rerr := bpfmap.Entries[uint64, sksSksContainer](l.objs.SksContainers)
	if rerr != nil {
		return errors.Join(err, rerr)
	}
	for _, oc := range all {
		if oc.Ip == c.Ip {
			return err
		}
	}
	return errors.Join(err, l.forgetPorts(c.Ip))
}

// PruneEndpoints removes the cgroup links and brokers of containers that
// are no longer local endpoints (deleted while the agent was down).
func (l *dataPlane) PruneEndpoints(local []cluster.Endpoint) error {
	keep := map[string]bool{}
	for _, e := range local {
		if dir, err := cgroup.Dir(l.cfg.CgroupRoot, e); err == nil {
			if id, err := cgroup.ID(dir); err == nil {
				keep[cgroupLinks(id)] = true
			}
		}
	}
	entries, err := os.ReadDir(l.linkDir())
	if err != nil {
		return fmt.Errorf("link pins: %w", err)
	}
	var errs []error
	for _, ent := range entries {
		name := ent.Name()
		id, ok := strings.CutPrefix(name, "cg-")
		if !ok || keep[name] {
			continue
		}
		n, err := strconv.ParseUint(id, 10, 64)
		if err != nil {
			continue
		}
		errs = append(errs, l.unpinCgroup(n))
	}
	l.brokers.Prune(local)
	return errors.Join(errs...)
}

// cgroupLinks names the pin directory of a cgroup's links by the cgroup's
// id: bpffs refuses names with dots, which container IDs may have.
func cgroupLinks(id uint64) string { return "cg-" + strconv.FormatUint(id, 10) }

// teardown removes a host's sockets layer without loading it: tc filters,
// pinned links (which detaches the programs) and maps. Brokers are stopped;
// connections already on host sockets keep running until they close.
func teardown(pinDir, stateDir string) error {
	errs := []error{tc.DetachAll(&netlink.Handle{}, filterName), restoreAcceptLocal(stateDir)}
	removeHostStackRoutes(netip.Prefix{})
	overlay.UnjudgeInput(Mark)
	iptables.Delete("raw", "PREROUTING", notrackRule...)
	errs = append(errs, broker.StopAll(stateDir), bpffs.Unpin(pinDir, "sks_"), bpffs.Unpin(pinDir, "skl_"), limits.TeardownIngress())
	return errors.Join(errs...)
}
