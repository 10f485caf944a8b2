package cache

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/iptables"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/tc"
)

// filterName tags skiff's tc filters so they can be told from others'.
const filterName = "skiff-cache"

func attach(h *netlink.Handle, link netlink.Link, prog *ebpf.Program, hook uint32) error {
	return tc.Attach(h, link, hook, tc.PrioCache, filterName, prog)
}

// Setup attaches the underlay programs and installs the overlay's
// established-mark rule.
func (c *fastPath) Setup() error {
	h := &netlink.Handle{}
	if err := attach(h, c.underlay, c.objs.FromUnderlay, netlink.HANDLE_MIN_INGRESS); err != nil {
		return err
	}
	if err := attach(h, c.underlay, c.objs.ToUnderlay, netlink.HANDLE_MIN_EGRESS); err != nil {
		return err
	}
	if err := c.setVXLAN(); err != nil {
		return err
	}
	// The fast path takes packets conntrack never sees; without liberal
	// window tracking conntrack would call the flow's FIN or RST invalid
	// (out of window) and never end the flow.
	if err := os.WriteFile(liberal, []byte("1"), 0o644); err != nil {
		return fmt.Errorf("conntrack liberal TCP tracking: %w", err)
	}
	return markRules(c.cfg).Install()
}

const markChain = "SKIFF-CACHE"

// liberal is conntrack's setting for liberal TCP window tracking.
const liberal = "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal"

// markRules are the rules the fast path needs from the overlay: every
// overlay packet forwarded between containers gets LearnMark (so
// to_underlay tells the VXLAN device's packets from look-alikes), and
// packets the fast path missed (miss mark) that belong to an established
// flow get the established mark, which tells the init programs the overlay
// let the flow through. Only overlay-to-overlay traffic is matched, so no
// mark is ever set on a packet leaving the overlay.
func markRules(cfg config) iptables.Chain {
	cidr := cfg.Cluster.CIDR.String()
	return iptables.Chain{Table: "mangle", Name: markChain,
		Rules: []string{
			fmt.Sprintf("-j MARK --or-mark %#x", LearnMark),
			fmt.Sprintf("-m conntrack --ctstate ESTABLISHED -m tos --tos 0x%02x/0x%02x -j TOS --or-tos 0x%02x", markMiss, markMiss, markEst),
		},
		Jumps: []iptables.Jump{{From: "FORWARD", Rule: []string{"-s", cidr, "-d", cidr, "-m", "comment", "--comment", "skiff cache", "-j", markChain}}},
	}
}

// Marks as in cache.h.
const (
	markMiss = 0x04
	markEst  = 0x08
	// LearnMark is the skb mark bit of overlay packets forwarded into the
	// VXLAN device, the only ones to_underlay learns from.
	LearnMark = 0x1000
)

// AddEndpoint attaches the fast path to a local container: its complete
// ingress cache entry (host-side veth, the MACs the overlay delivers with,
// its namespace's id for the listener check of flows.h), from_container on
// the host-side veth and to_container on the container's interface.
func (c *fastPath) AddEndpoint(e cluster.Endpoint) error {
	veth, err := netlink.LinkByName(e.Veth)
	if err != nil {
		return fmt.Errorf("host veth %s: %w", e.Veth, err)
	}
	ns, err := overlay.OpenNetns(e)
	if err != nil {
		return fmt.Errorf("container namespace: %w", err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", e.Netns, err)
	}
	defer h.Close()
	link, err := h.LinkByName(e.IfName)
	if err != nil {
		return fmt.Errorf("container %s: %w", e.IfName, err)
	}
	id, err := netnsID(int(ns))
	if err != nil {
		return fmt.Errorf("container namespace %s: %w", e.Netns, err)
	}
	ep := skcIngressEp{Ifindex: uint32(veth.Attrs().Index), Ready: 1, NetnsId: id}
	copy(ep.MacDst[:], link.Attrs().HardwareAddr)
	copy(ep.MacSrc[:], overlay.BridgeMAC(c.cfg.Host.UnderlayIP))
	if e.Limit.IngressRate > 0 {
		ep.Shaped = 1 // delivered through the host veth's qdisc (overlay.shape)
	}
	key := e.IP.Addr().As4()
	var have skcIngressEp
	if err := c.objs.SkcIngress.Lookup(key, &have); err != nil || have != ep {
		if err := c.objs.SkcIngress.Put(key, ep); err != nil {
			return fmt.Errorf("ingress cache entry for %s: %w", e.IP, err)
		}
	}
	if err := attach(&netlink.Handle{}, veth, c.objs.FromContainer, netlink.HANDLE_MIN_INGRESS); err != nil {
		return err
	}
	return attach(h, link, c.objs.ToContainer, netlink.HANDLE_MIN_INGRESS)
}

// netnsID is the id of the namespace open as fd in this one, allocated if
// it has none.
func netnsID(fd int) (int32, error) {
	id, err := netlink.GetNetNsIdByFd(fd)
	if err == nil && id < 0 {
		if err = netlink.SetNetNsIdByFd(fd, -1); err == nil {
			id, err = netlink.GetNetNsIdByFd(fd)
		}
	}
	if err != nil {
		return -1, fmt.Errorf("namespace id: %w", err)
	}
	return int32(id), nil
}

// RemoveEndpoint forgets a local container: its ingress entry and every
// flow and connection naming its address. (Other hosts purge their egress entries for it
// when they see the endpoint go; see Sync.) The programs go with the veth.
func (c *fastPath) RemoveEndpoint(e cluster.Endpoint) error {
	key := e.IP.Addr().As4()
	if err := c.objs.SkcIngress.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete ingress entry %s: %w", e.IP, err)
	}
	ip := be32(e.IP.Addr())
	_, err1 := c.purgeFlows(func(k skcFlowKey) bool { return k.Laddr == ip || k.Raddr == ip })
	_, err2 := c.purgeConnections(func(k skcFlowKey, _ skcFlowState) bool { return k.Laddr == ip || k.Raddr == ip })
	return errors.Join(err1, err2, c.forgetTunnel(ip))
}

// pinned reports whether a fast path's maps are pinned in dir.
func pinned(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, "skc_control"))
	return err == nil
}

// teardown removes a host's fast path without loading it: skiff's programs
// from every link of the host namespace (the underlay device and the
// containers' host-side veths), the mark rule and the pinned maps. The
// overlay carries everything afterwards. A to_container program left inside
// a container only clears the two reserved DSCP bits, which nothing sets any
// more; it goes with the container's interface.
func teardown(cfg config) error {
	errs := []error{tc.DetachAll(&netlink.Handle{}, filterName)}
	markRules(cfg).Remove()
	errs = append(errs, bpffs.Unpin(cfg.PinDir, "skc_"))
	return errors.Join(errs...)
}
