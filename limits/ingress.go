package limits

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/netlinksafe"
	"github.com/skiffnet/skiff/tc"
)

// IFBName is the device on which the ingress of limited containers' host
// sockets is shaped: one HTB class per container (skl_classify sends
// their packets through it).
const IFBName = "skiff-ifb"

// filterName tags skl_classify on the devices host sockets receive on.
const filterName = "skiff-limits"

// shapeIngress gives a container's host sockets an HTB class of rate
// bit/s on the IFB (made on first use) and returns its minor: class, the
// one it had (0: none), or a free one. Rate 0 removes class.
func (c *Cgroups) shapeIngress(class uint32, rate, burst uint64) (uint32, error) {
	h := &netlink.Handle{}
	if rate == 0 {
		if class == 0 {
			return 0, nil
		}
		if l, err := netlink.LinkByName(IFBName); err == nil {
			cl := netlink.NewHtbClass(netlink.ClassAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.MakeHandle(handle, 0),
				Handle: netlink.MakeHandle(handle, uint16(class))}, netlink.HtbClassAttrs{})
			if err := h.ClassDel(cl); err != nil && !errors.Is(err, unix.ENOENT) {
				return 0, fmt.Errorf("remove ingress class %x:%x: %w", handle, class, err)
			}
		}
		return 0, nil
	}
	dev, err := c.ifb(h)
	if err != nil {
		return 0, err
	}
	if class == 0 {
		if class, err = c.freeClass(); err != nil {
			return 0, err
		}
	}
	return class, setClass(h, dev, uint16(class), rate, burst)
}

// ifb returns the IFB device, made and shaped (HTB, unclassified packets
// pass) with skl_classify on the devices host sockets receive on.
func (c *Cgroups) ifb(h *netlink.Handle) (netlink.Link, error) {
	dev, err := netlink.LinkByName(IFBName)
	if err != nil {
		if err := h.LinkAdd(&netlink.Ifb{LinkAttrs: netlink.LinkAttrs{Name: IFBName, TxQLen: 1000}}); err != nil && !errors.Is(err, unix.EEXIST) {
			return nil, fmt.Errorf("create %s: %w", IFBName, err)
		}
		if dev, err = netlink.LinkByName(IFBName); err != nil {
			return nil, fmt.Errorf("%s: %w", IFBName, err)
		}
	}
	if err := h.LinkSetUp(dev); err != nil {
		return nil, fmt.Errorf("set %s up: %w", IFBName, err)
	}
	if ours, err := shaped(h, dev); err != nil {
		return nil, err
	} else if !ours {
		qdisc := netlink.NewHtb(netlink.QdiscAttrs{LinkIndex: dev.Attrs().Index, Handle: netlink.MakeHandle(handle, 0), Parent: netlink.HANDLE_ROOT})
		if err := h.QdiscReplace(qdisc); err != nil {
			return nil, fmt.Errorf("HTB on %s: %w", IFBName, err)
		}
	}
	if err := c.objs.SklIfb.Put(uint32(0), uint32(dev.Attrs().Index)); err != nil {
		return nil, fmt.Errorf("IFB index: %w", err)
	}
	for _, name := range []string{c.underlay, "lo"} {
		l, err := netlink.LinkByName(name)
		if err == nil {
			err = tc.Attach(h, l, tc.Ingress, tc.PrioLimits, filterName, c.objs.SklClassify)
		}
		if err != nil {
			return nil, fmt.Errorf("ingress shaping on %s: %w", name, err)
		}
	}
	return dev, nil
}

// unclassify takes skl_classify off the underlay and lo once no container
// has an ingress class: it costs every TCP packet they receive a socket
// lookup.
func (c *Cgroups) unclassify() error {
	all, err := bpfmap.Entries[uint64, sklSklLimit](c.objs.SklLimits)
	if err != nil {
		return err
	}
	for _, e := range all {
		if e.Class != 0 {
			return nil
		}
	}
	h := &netlink.Handle{}
	var errs []error
	for _, name := range []string{c.underlay, "lo"} {
		if l, err := netlink.LinkByName(name); err == nil {
			errs = append(errs, tc.Detach(h, l, tc.Ingress, filterName))
		}
	}
	return errors.Join(errs...)
}

// freeClass returns the lowest minor class (above the veths' 1) no
// container's entry holds.
func (c *Cgroups) freeClass() (uint32, error) {
	all, err := bpfmap.Entries[uint64, sklSklLimit](c.objs.SklLimits)
	if err != nil {
		return 0, err
	}
	used := map[uint32]bool{}
	for _, e := range all {
		used[e.Class] = true
	}
	for class := uint32(2); class < 0xffff; class++ {
		if !used[class] {
			return class, nil
		}
	}
	return 0, fmt.Errorf("no free class on %s: 65533 containers limited", IFBName)
}

// TeardownIngress removes the IFB device and skl_classify from every
// device: what the ingress shaping of host sockets put on the host.
func TeardownIngress() error {
	links, err := netlinksafe.Dump(netlink.LinkList)
	if err != nil {
		return fmt.Errorf("list links: %w", err)
	}
	h := &netlink.Handle{}
	var errs []error
	for _, l := range links {
		if l.Attrs().Name == IFBName {
			errs = append(errs, h.LinkDel(l))
			continue
		}
		errs = append(errs, tc.Detach(h, l, tc.Ingress, filterName))
	}
	return errors.Join(errs...)
}
