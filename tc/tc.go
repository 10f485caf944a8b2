// Package tc attaches skiff's eBPF programs to the tc (clsact) hooks of
// network devices. Each layer tags its filters with its own name, so layers
// never remove each other's programs.
package tc

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/netlinksafe"
)

// Hooks of a device.
const (
	Ingress = netlink.HANDLE_MIN_INGRESS
	Egress  = netlink.HANDLE_MIN_EGRESS
)

// Priorities of skiff's filters on a device's hook: lower runs first. This
// is the one place the order of every layer's tc programs is defined: each
// is a clsact filter (direct action), none a TCX link. A program that does
// not take a packet returns TC_ACT_UNSPEC, and the next filter sees it; one
// that takes it (redirect, drop, or "the stack's": TC_ACT_OK) ends the hook.
// docs/layers.md has the map of which device carries which.
const (
	// PrioSource is the overlay's source check on a container's host-side
	// veth: every layer sees only what it passed.
	PrioSource = iota + 1
	// PrioPolice is a limited container's egress policer: no layer may
	// carry what is over the limit.
	PrioPolice
	// PrioSteering are the steering layer's programs: they only write the
	// packet's hash, and always pass it on.
	PrioSteering
	// PrioRecorder is the sockets layer's SYN recorder on the underlay's
	// ingress: it sees every packet before a layer takes it, and takes
	// none (but drops forged SYNs).
	PrioRecorder
	// PrioSockets: the sockets layer's checks of a container's TCP must
	// see every packet, and packets it turns to the host stack are no
	// other layer's.
	PrioSockets
	// PrioCache is the cache's fast path: it redirects what it takes.
	PrioCache
	// PrioLimits is the ingress shaping of host sockets (limits.c) on the
	// underlay and lo, and the QoS classes on the underlay's egress, after
	// the cache (which takes VXLAN packets only).
	PrioLimits
)

// Attach puts prog, named name, on link's hook (clsact, direct action) at
// priority prio. Replacing the filter is atomic, so re-attaching after an
// agent restart swaps programs without a gap.
func Attach(h *netlink.Handle, link netlink.Link, hook uint32, prio uint16, name string, prog *ebpf.Program) error {
	qdisc := &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: link.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
		QdiscType:  "clsact",
	}
	if err := h.QdiscAdd(qdisc); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("clsact on %s: %w", link.Attrs().Name, err)
	}
	f := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: link.Attrs().Index, Parent: hook, Handle: 1,
			Protocol: unix.ETH_P_ALL, Priority: prio},
		Fd: prog.FD(), Name: name, DirectAction: true,
	}
	if err := h.FilterReplace(f); err != nil {
		return fmt.Errorf("attach %s to %s: %w", name, link.Attrs().Name, err)
	}
	// A filter of the same name at another priority is an older skiff's
	// (priorities have changed): it would run besides, in the old order.
	filters, err := netlinksafe.Dump(func() ([]netlink.Filter, error) { return h.FilterList(link, hook) })
	if err != nil {
		return fmt.Errorf("filters of %s: %w", link.Attrs().Name, err)
	}
	for _, old := range filters {
		if bf, ok := old.(*netlink.BpfFilter); ok && bf.Name == name && bf.Priority != prio {
			if err := h.FilterDel(old); err != nil && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("remove %s at priority %d from %s: %w", name, bf.Priority, link.Attrs().Name, err)
			}
		}
	}
	return nil
}

// Attached reports whether link's hook has a filter named name at prio
// that runs the program with id.
func Attached(h *netlink.Handle, link netlink.Link, hook uint32, prio uint16, name string, id int) (bool, error) {
	filters, err := netlinksafe.Dump(func() ([]netlink.Filter, error) { return h.FilterList(link, hook) })
	if err != nil {
		return false, fmt.Errorf("filters of %s: %w", link.Attrs().Name, err)
	}
	for _, f := range filters {
		if bf, ok := f.(*netlink.BpfFilter); ok && bf.Name == name && bf.Priority == prio && bf.Id == id {
			return true, nil
		}
	}
	return false, nil
}

// Detach removes the filters named name from link's hook; none is fine.
func Detach(h *netlink.Handle, link netlink.Link, hook uint32, name string) error {
	_, err := detach(h, link, hook, func(n string) bool { return n == name })
	return err
}

// DetachAll removes the filters named name from both hooks of every
// device in h's namespace: a layer's teardown.
func DetachAll(h *netlink.Handle, name string) error {
	links, err := netlinksafe.Dump(h.LinkList)
	if err != nil {
		return fmt.Errorf("list links: %w", err)
	}
	var errs []error
	for _, lk := range links {
		errs = append(errs, Detach(h, lk, Ingress, name), Detach(h, lk, Egress, name))
	}
	return errors.Join(errs...)
}

// DetachPrefix removes from both hooks of link every filter whose name
// starts with prefix, and returns how many it removed.
func DetachPrefix(h *netlink.Handle, link netlink.Link, prefix string) (int, error) {
	n := 0
	for _, hook := range []uint32{Ingress, Egress} {
		k, err := detach(h, link, hook, func(name string) bool { return strings.HasPrefix(name, prefix) })
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// detach removes the filters of link's hook whose names match.
func detach(h *netlink.Handle, link netlink.Link, hook uint32, match func(string) bool) (int, error) {
	filters, err := netlinksafe.Dump(func() ([]netlink.Filter, error) { return h.FilterList(link, hook) })
	if err != nil {
		return 0, fmt.Errorf("filters of %s: %w", link.Attrs().Name, err)
	}
	n := 0
	for _, f := range filters {
		if bf, ok := f.(*netlink.BpfFilter); ok && match(bf.Name) {
			if err := h.FilterDel(f); err != nil && !errors.Is(err, unix.ENOENT) {
				return n, fmt.Errorf("detach %s from %s: %w", bf.Name, link.Attrs().Name, err)
			}
			n++
		}
	}
	return n, nil
}
