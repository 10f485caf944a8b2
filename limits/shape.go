// Package limits puts containers' rate limits and QoS classes
// (cluster.Limit) on the data path: shape.go shapes their veths (HTB),
// police.go polices their egress on the host side, which a container
// cannot send around, cgroups.go and ingress.go hold their host sockets to
// the limit (token buckets on their cgroups, an IFB for ingress), and
// qos.go marks and shapes the underlay by class.
package limits

import (
	"errors"
	"fmt"
	"math"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// handle is the major number of skiff's HTB qdiscs: a root qdisc with
// another handle is someone else's, and skiff leaves it alone.
const handle = 0x5c

// noDirectQueue is the length of skiff's HTBs' direct queue: none. HTB
// sends a packet whose skb->priority is the qdisc's handle (5c:0) to that
// queue, unshaped and first, and a container chooses its packets'
// priority (SO_PRIORITY, with CAP_NET_RAW, which runtimes grant): with no
// room there, such a packet is dropped instead of skipping the limit.
var noDirectQueue uint32 = 0

// Shape makes the root qdisc of link (through h, in link's namespace) an
// HTB that sends at most rate bit/s with bursts of burst bits, or, with
// rate 0, removes skiff's HTB. HTB queues what is over the rate rather
// than dropping it (a TCP sender slows down, a UDP flood's excess waits,
// then drops at the queue's end). Changing the rate replaces the class in
// place: queued packets stay. Idempotent.
func Shape(h *netlink.Handle, link netlink.Link, rate, burst uint64) error {
	name := link.Attrs().Name
	qdisc := netlink.NewHtb(netlink.QdiscAttrs{LinkIndex: link.Attrs().Index, Handle: netlink.MakeHandle(handle, 0), Parent: netlink.HANDLE_ROOT})
	ours, err := shapedNoDirect(h, link, rate != 0)
	switch {
	case err != nil:
		return err
	case rate == 0 && !ours:
		return nil
	case rate == 0:
		if err := h.QdiscDel(qdisc); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("remove the rate limit of %s: %w", name, err)
		}
		return nil
	case !ours: // HTB has no change operation: an existing one keeps its qdisc, the class changes
		qdisc.Defcls = 1
		qdisc.DirectQlen = &noDirectQueue
		if err := h.QdiscReplace(qdisc); err != nil {
			return fmt.Errorf("rate limit on %s: %w", name, err)
		}
	}
	return setClass(h, link, 1, rate, burst)
}

// setClass adds or changes (in place) the class minor of skiff's HTB on
// link: rate bit/s, bursts of burst bits.
func setClass(h *netlink.Handle, link netlink.Link, minor uint16, rate, burst uint64) error {
	return setClassUnder(h, link, 0, minor, rate, rate, burst, 0)
}

// setClassUnder is setClass for a class under the class parent (0: the
// qdisc) that may borrow from it up to ceil, with the HTB priority prio.
func setClassUnder(h *netlink.Handle, link netlink.Link, parent, minor uint16, rate, ceil, burst uint64, prio uint32) error {
	bytes := min(burst/8, math.MaxUint32)
	class := netlink.NewHtbClass(netlink.ClassAttrs{LinkIndex: link.Attrs().Index, Parent: netlink.MakeHandle(handle, parent),
		Handle: netlink.MakeHandle(handle, minor)}, netlink.HtbClassAttrs{Rate: rate, Ceil: ceil, Buffer: uint32(bytes), Cbuffer: uint32(bytes), Prio: prio})
	if err := h.ClassReplace(class); err != nil {
		return fmt.Errorf("rate limit class %x:%x on %s: %w", handle, minor, link.Attrs().Name, err)
	}
	return nil
}

// shapedNoDirect is shaped, but removes first (when keep) an HTB of skiff's
// that an earlier version made with a direct queue: HTB cannot change it
// in place, and the limit is unshaped for the moment it takes.
func shapedNoDirect(h *netlink.Handle, link netlink.Link, keep bool) (bool, error) {
	ours, err := shaped(h, link)
	if err != nil || !ours || !keep {
		return ours, err
	}
	qdiscs, err := h.QdiscList(link)
	if err != nil {
		return false, fmt.Errorf("qdiscs of %s: %w", link.Attrs().Name, err)
	}
	for _, q := range qdiscs {
		if htb, ok := q.(*netlink.Htb); ok && htb.Parent == netlink.HANDLE_ROOT && htb.Handle == netlink.MakeHandle(handle, 0) &&
			htb.DirectQlen != nil && *htb.DirectQlen != 0 {
			if err := h.QdiscDel(htb); err != nil && !errors.Is(err, unix.ENOENT) {
				return false, fmt.Errorf("replace the HTB of %s: %w", link.Attrs().Name, err)
			}
			return false, nil
		}
	}
	return true, nil
}

// shaped reports whether link's root qdisc is skiff's HTB.
func shaped(h *netlink.Handle, link netlink.Link) (bool, error) {
	qdiscs, err := h.QdiscList(link)
	if err != nil {
		return false, fmt.Errorf("qdiscs of %s: %w", link.Attrs().Name, err)
	}
	for _, q := range qdiscs {
		a := q.Attrs()
		if a.Parent == netlink.HANDLE_ROOT && a.Handle == netlink.MakeHandle(handle, 0) && q.Type() == "htb" {
			return true, nil
		}
	}
	return false, nil
}
