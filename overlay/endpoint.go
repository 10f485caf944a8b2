package overlay

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/limits"
	"github.com/skiffnet/skiff/netlinksafe"
	"github.com/skiffnet/skiff/timing"
)

// Attachment is what AddEndpoint built.
type Attachment struct {
	HostVethMAC  string
	ContainerMAC string
	Gateway      netip.Addr
	MTU          int
}

// ErrNetnsGone means the container's network namespace no longer exists.
var ErrNetnsGone = errors.New("network namespace does not exist")

// ErrNetnsChanged means an endpoint's namespace path now names another
// namespace than the one its endpoint was attached in.
var ErrNetnsChanged = errors.New("names another network namespace than the one the endpoint was attached in")

// ErrNetnsHidden means an endpoint's namespace path is the runtime's, in a
// mount namespace the agent does not share (cluster.Endpoint.NetnsHidden).
var ErrNetnsHidden = errors.New("names the namespace in the runtime's mount namespace only, not in skiffd's")

// NetnsID returns the identity of the namespace at path: the device and
// inode of its nsfs file.
func NetnsID(path string) (dev, ino uint64, err error) {
	ns, err := openNetns(path)
	if err != nil {
		return 0, 0, err
	}
	defer ns.Close()
	return nsID(ns)
}

func nsID(ns netns.NsHandle) (dev, ino uint64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(ns), &st); err != nil {
		return 0, 0, fmt.Errorf("stat network namespace: %w", err)
	}
	return st.Dev, st.Ino, nil
}

func openNetns(path string) (netns.NsHandle, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return 0, fmt.Errorf("%s: %w", path, ErrNetnsGone)
		}
		return 0, fmt.Errorf("open network namespace %s: %w", path, err)
	}
	return ns, nil
}

// OpenNetns opens e's namespace and checks, on the opened handle, that it
// is the namespace e was attached in (when e records it): whoever enters
// through the handle enters what was checked. A path that now names
// another namespace is ErrNetnsChanged.
func OpenNetns(e cluster.Endpoint) (netns.NsHandle, error) {
	if e.NetnsHidden {
		return 0, fmt.Errorf("%s: %w", e.Netns, ErrNetnsHidden)
	}
	ns, err := openNetns(e.Netns)
	if err != nil || e.NetnsIno == 0 {
		return ns, err
	}
	dev, ino, err := nsID(ns)
	if err == nil && (dev != e.NetnsDev || ino != e.NetnsIno) {
		err = fmt.Errorf("%s (device %d inode %d, attached in %d/%d) %w", e.Netns, dev, ino, e.NetnsDev, e.NetnsIno, ErrNetnsChanged)
	}
	if err != nil {
		ns.Close()
		return 0, err
	}
	return ns, nil
}

// inNetns opens e's namespace (OpenNetns) and returns the handle and a
// netlink handle bound to it, so no OS thread has to switch namespaces.
func inNetns(e cluster.Endpoint) (*netlink.Handle, netns.NsHandle, func(), error) {
	ns, err := OpenNetns(e)
	if err != nil {
		return nil, 0, nil, err
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		ns.Close()
		return nil, 0, nil, fmt.Errorf("netlink in %s: %w", e.Netns, err)
	}
	return h, ns, func() { h.Close(); ns.Close() }, nil
}

// AddEndpoint creates the veth pair of endpoint e: the host side on the
// bridge, the container side named e.IfName in e.Netns with e.IP, the MTU of
// the overlay and a route via the host's gateway (the default route, or the
// cluster CIDR's on a secondary network). Adding an endpoint
// that is already intact changes nothing; a half-built one is rebuilt.
func (o *Overlay) AddEndpoint(e cluster.Endpoint) (Attachment, error) {
	if o.src == nil {
		return Attachment{}, errNoSourceCheck
	}
	steps := o.stepsOf("endpoint attach slow", e)
	defer steps.Done()
	a, err := o.checkLinks(e)
	steps.Step("check")
	if err == nil {
		host, err := netlink.LinkByName(e.Veth)
		if err == nil {
			mac, _ := net.ParseMAC(a.ContainerMAC)
			err = o.src.guard(host, e.IP.Addr(), mac)
		}
		if err == nil {
			err = hairpin(host)
		}
		if err == nil {
			err = o.reshape(e, host)
		}
		if err != nil {
			return Attachment{}, err
		}
		return a, nil
	}
	h, ns, done, err := inNetns(e)
	if err != nil {
		return Attachment{}, err
	}
	defer done()
	steps.Step("netns")
	if err := deleteLink(netlink.LinkByName, netlink.LinkDel, e.Veth); err != nil {
		return Attachment{}, err
	}
	if l, err := h.LinkByName(e.IfName); err == nil {
		return Attachment{}, fmt.Errorf("container already has an interface %s (%s) that skiff did not make", e.IfName, l.Type())
	}
	br, err := netlink.LinkByName(BridgeName)
	if err != nil {
		return Attachment{}, fmt.Errorf("bridge %s: %w", BridgeName, err)
	}
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: e.Veth, MTU: o.mtu, MasterIndex: br.Attrs().Index},
		PeerName:      e.IfName,
		PeerNamespace: netlink.NsFd(int(ns)),
	}
	// The container keeps the MAC the runtime asked for, or the one it had.
	if mac, err := net.ParseMAC(e.MAC); err == nil {
		veth.PeerHardwareAddr = mac
	}
	steps.Step("lookups")
	if err := netlink.LinkAdd(veth); err != nil {
		return Attachment{}, fmt.Errorf("create veth %s/%s: %w", e.Veth, e.IfName, err)
	}
	steps.Step("veth")
	a, err = o.configure(h, e, steps)
	if err != nil {
		_ = deleteLink(netlink.LinkByName, netlink.LinkDel, e.Veth)
		return Attachment{}, err
	}
	return a, nil
}

func (o *Overlay) configure(h *netlink.Handle, e cluster.Endpoint, steps *timing.Steps) (Attachment, error) {
	host, err := netlink.LinkByName(e.Veth)
	if err != nil {
		return Attachment{}, fmt.Errorf("host veth %s: %w", e.Veth, err)
	}
	c, err := h.LinkByName(e.IfName)
	if err != nil {
		return Attachment{}, fmt.Errorf("container %s: %w", e.IfName, err)
	}
	// Before the veth is up: nothing the container sends goes unchecked.
	if err := o.src.guard(host, e.IP.Addr(), c.Attrs().HardwareAddr); err != nil {
		return Attachment{}, err
	}
	steps.Step("source check")
	if err := hairpin(host); err != nil {
		return Attachment{}, err
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return Attachment{}, fmt.Errorf("set %s up: %w", e.Veth, err)
	}
	steps.Step("host veth")
	if err := h.AddrReplace(c, &netlink.Addr{IPNet: prefixNet(e.IP)}); err != nil {
		return Attachment{}, fmt.Errorf("address %s on container %s: %w", e.IP, e.IfName, err)
	}
	for _, l := range []string{"lo", e.IfName} {
		link, err := h.LinkByName(l)
		if err == nil {
			err = h.LinkSetUp(link)
		}
		if err != nil {
			return Attachment{}, fmt.Errorf("set container %s up: %w", l, err)
		}
	}
	gw := cluster.Gateway(e.IP)
	dst := o.routeTo(e)
	if err := h.RouteReplace(&netlink.Route{LinkIndex: c.Attrs().Index, Dst: prefixNet(dst), Gw: gw.AsSlice()}); err != nil {
		return Attachment{}, fmt.Errorf("route to %s via %s in container: %w", dst, gw, err)
	}
	steps.Step("container side")
	if !e.Limit.None() { // a new veth pair has no qdisc of skiff's to remove
		if err := o.shape(h, c, host, e.Limit); err != nil {
			return Attachment{}, err
		}
	}
	return Attachment{HostVethMAC: host.Attrs().HardwareAddr.String(), ContainerMAC: c.Attrs().HardwareAddr.String(), Gateway: gw, MTU: o.mtu}, nil
}

// shape puts a rate limit on a veth pair: egress on the container's
// interface c (through h, in its namespace: before any skiff program sees
// a packet, so every layer that takes the packet from the host veth gets
// it shaped) and, where the container cannot send around it, policed on
// the host veth's ingress (police.c: a packet socket bypasses the
// container's qdisc); ingress on the host veth's egress, where the overlay
// and the cache (cache.c: a shaped endpoint's packets are not redirected
// to the peer) deliver. Limits of zero remove skiff's qdiscs and policer.
func (o *Overlay) shape(h *netlink.Handle, c, host netlink.Link, l cluster.Limit) error {
	return errors.Join(limits.Shape(h, c, l.EgressRate, l.EgressBurst),
		o.police.Set(&netlink.Handle{}, host, l.EgressRate, l.EgressBurst),
		limits.Shape(&netlink.Handle{}, host, l.IngressRate, l.IngressBurst))
}

// routeTo is what a container's route to the overlay covers: everything
// (its default route), or the cluster CIDR alone on a secondary network.
func (o *Overlay) routeTo(e cluster.Endpoint) netip.Prefix {
	if e.ClusterRoute {
		return o.cfg.Cluster.CIDR.Masked()
	}
	return netip.PrefixFrom(netip.IPv4Unspecified(), 0)
}

// routeDst is a route's destination as a prefix (a default route's is
// 0.0.0.0/0).
func routeDst(r netlink.Route) netip.Prefix {
	if r.Dst == nil {
		return netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	}
	a, _ := netip.AddrFromSlice(r.Dst.IP.To4())
	ones, _ := r.Dst.Mask.Size()
	return netip.PrefixFrom(a, ones)
}

// CheckEndpoint verifies that e's interfaces, address and route are intact
// and that its veth checks the container's source addresses.
func (o *Overlay) CheckEndpoint(e cluster.Endpoint) (Attachment, error) {
	a, err := o.checkLinks(e)
	if err != nil {
		return Attachment{}, err
	}
	if o.src == nil {
		return Attachment{}, errNoSourceCheck
	}
	host, err := netlink.LinkByName(e.Veth)
	if err == nil {
		err = o.src.check(host, e.IP.Addr())
	}
	if err != nil {
		return Attachment{}, err
	}
	return a, nil
}

// checkLinks verifies that e's interfaces, address and route are intact.
func (o *Overlay) checkLinks(e cluster.Endpoint) (Attachment, error) {
	host, err := netlink.LinkByName(e.Veth)
	if err != nil {
		return Attachment{}, fmt.Errorf("host veth %s: %w", e.Veth, err)
	}
	br, err := netlink.LinkByName(BridgeName)
	if err != nil {
		return Attachment{}, fmt.Errorf("bridge %s: %w", BridgeName, err)
	}
	if host.Attrs().MasterIndex != br.Attrs().Index || host.Attrs().Flags&net.FlagUp == 0 {
		return Attachment{}, fmt.Errorf("host veth %s is not up on %s", e.Veth, BridgeName)
	}
	h, _, done, err := inNetns(e)
	if err != nil {
		return Attachment{}, err
	}
	defer done()
	c, err := h.LinkByName(e.IfName)
	if err != nil {
		return Attachment{}, fmt.Errorf("container interface %s: %w", e.IfName, err)
	}
	if c.Attrs().ParentIndex != host.Attrs().Index {
		return Attachment{}, fmt.Errorf("container %s is not the peer of %s", e.IfName, e.Veth)
	}
	// A container keeps the MTU it was created with when the host changes
	// Config.FullMTU.
	if m := c.Attrs().MTU; m != o.mtu && m != o.underlay.Attrs().MTU-Overhead && m != o.underlay.Attrs().MTU {
		return Attachment{}, fmt.Errorf("container %s MTU is %d, want %d", e.IfName, m, o.mtu)
	}
	addrs, err := h.AddrList(c, netlink.FAMILY_V4)
	if err != nil {
		return Attachment{}, fmt.Errorf("addresses of container %s: %w", e.IfName, err)
	}
	found := false
	for _, a := range addrs {
		found = found || a.IPNet.String() == prefixNet(e.IP).String()
	}
	if !found {
		return Attachment{}, fmt.Errorf("container %s lacks address %s", e.IfName, e.IP)
	}
	gw := cluster.Gateway(e.IP)
	routes, err := h.RouteList(c, netlink.FAMILY_V4)
	if err != nil {
		return Attachment{}, fmt.Errorf("routes of container %s: %w", e.IfName, err)
	}
	found = false
	dst := o.routeTo(e)
	for _, r := range routes {
		found = found || routeDst(r) == dst && r.Gw.Equal(gw.AsSlice())
	}
	if !found {
		return Attachment{}, fmt.Errorf("container has no route to %s via %s", dst, gw)
	}
	return Attachment{HostVethMAC: host.Attrs().HardwareAddr.String(), ContainerMAC: c.Attrs().HardwareAddr.String(), Gateway: gw, MTU: c.Attrs().MTU}, nil
}

// RemoveEndpoint deletes e's veth pair, then its source check. A namespace
// or link that is already gone is success. The container side is looked for
// only in the namespace e was attached in: when e does not record it, or
// its path now names another namespace, only the host side is deleted
// (which takes its peer with it, wherever it is).
func (o *Overlay) RemoveEndpoint(e cluster.Endpoint) error {
	steps := o.stepsOf("endpoint removal slow", e)
	defer steps.Done()
	var ifindex uint32
	if l, err := netlink.LinkByName(e.Veth); err == nil {
		ifindex = uint32(l.Attrs().Index)
	}
	if e.NetnsIno != 0 {
		if h, _, done, err := inNetns(e); err == nil {
			defer done()
			steps.Step("netns")
			if err := deleteLink(h.LinkByName, h.LinkDel, e.IfName); err != nil {
				return err
			}
		} else if errors.Is(err, ErrNetnsChanged) {
			o.log.Warn("not entering the namespace of a deleted endpoint: its path names another namespace now", "container", e.ContainerID, "err", err)
		} else if !errors.Is(err, ErrNetnsGone) && !errors.Is(err, ErrNetnsHidden) {
			return err
		}
	}
	steps.Step("container side")
	if err := deleteLink(netlink.LinkByName, netlink.LinkDel, e.Veth); err != nil {
		return err
	}
	steps.Step("host veth")
	if o.src == nil || ifindex == 0 {
		return nil
	}
	var err error
	if o.police != nil {
		err = o.police.Forget(ifindex)
	}
	return errors.Join(err, o.src.unguard(ifindex))
}

func deleteLink(byName func(string) (netlink.Link, error), del func(netlink.Link) error, name string) error {
	l, err := byName(name)
	if errors.As(err, &netlink.LinkNotFoundError{}) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("look up %s: %w", name, err)
	}
	if err := del(l); err != nil && !errors.As(err, &netlink.LinkNotFoundError{}) {
		return fmt.Errorf("delete %s: %w", name, err)
	}
	return nil
}

// PruneEndpoints deletes skiff veths that belong to no endpoint in keep: the
// leftovers of containers deleted while the agent was down.
func (o *Overlay) PruneEndpoints(keep []cluster.Endpoint) error {
	owned := map[string]bool{}
	for _, e := range keep {
		owned[e.Veth] = true
	}
	links, err := netlinksafe.Dump(netlink.LinkList)
	if err != nil {
		return fmt.Errorf("list links: %w", err)
	}
	var errs []error
	for _, l := range links {
		name := l.Attrs().Name
		if _, isVeth := l.(*netlink.Veth); isVeth && strings.HasPrefix(name, VethPrefix) && !owned[name] {
			o.log.Info("removing veth of a deleted endpoint", "veth", name)
			errs = append(errs, deleteLink(netlink.LinkByName, netlink.LinkDel, name))
		}
	}
	return errors.Join(errs...)
}

// hairpin lets the bridge send a frame back out of the port it came in on:
// a container's connection DNATed to the container itself (a Service it
// backends, kube-proxy masquerading it) is bridged back to it, which a
// bridge port drops otherwise. Idempotent.
func hairpin(host netlink.Link) error {
	if err := netlink.LinkSetHairpin(host, true); err != nil {
		return fmt.Errorf("hairpin on %s: %w", host.Attrs().Name, err)
	}
	return nil
}

// slowSteps is how long an endpoint's attach or removal may take before
// the agent logs where its time went (a burst of pods can stall one for
// seconds: docs/kubernetes.md "Performance").
const slowSteps = time.Second

// stepsOf times the steps of one endpoint change and logs them when the
// change was slow.
func (o *Overlay) stepsOf(msg string, e cluster.Endpoint) *timing.Steps {
	return timing.Start(o.log, msg, slowSteps, "container", e.ContainerID, "if", e.IfName)
}
