package overlay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
)

// SourceReasons names the source check's drop counters, indexed by enum
// skv_reason (source.h).
var SourceReasons = []string{"no_entry", "vlan", "mac_source", "ip_source", "arp_sender", "other_protocol", "malformed"}

// sourceCheck is a host's source check (source.c): skv_from_container at
// the head of every container's host-side veth's TCX ingress, and the
// container's address and MAC in skv_sources under the veth's ifindex. The
// maps and links are pinned in dir, so the check outlives the agent.
type sourceCheck struct {
	objs   skvObjects
	dir    string
	progID ebpf.ProgramID
}

func loadSourceCheck(dir string, log *slog.Logger) (*sourceCheck, error) {
	spec, err := loadSkv()
	if err != nil {
		return nil, fmt.Errorf("read source check: %w", err)
	}
	s := &sourceCheck{dir: dir}
	if err := bpffs.Load(spec, &s.objs, dir, log); err != nil {
		return nil, fmt.Errorf("load source check: %w", err)
	}
	info, err := s.objs.SkvFromContainer.Info()
	if err == nil {
		s.progID, _ = info.ID()
	}
	if err == nil {
		err = os.MkdirAll(s.linkDir(), 0o700)
	}
	if err != nil {
		s.objs.Close()
		return nil, fmt.Errorf("source check: %w", err)
	}
	return s, nil
}

func (s *sourceCheck) linkDir() string { return filepath.Join(s.dir, "skv_links") }

var errNoSourceCheck = errors.New("the source check is not loaded (overlay not set up)")

func sourceEntry(ip netip.Addr, mac net.HardwareAddr) skvSource {
	b := ip.As4()
	v := skvSource{Ip: binary.NativeEndian.Uint32(b[:])}
	copy(v.Mac[:], mac)
	return v
}

// guard makes veth pass only what the container sends from ip and mac:
// the entry first, then the program, so that the check never runs without
// its entry (it would drop everything). Idempotent.
func (s *sourceCheck) guard(veth netlink.Link, ip netip.Addr, mac net.HardwareAddr) error {
	if len(mac) != 6 {
		return fmt.Errorf("source check on %s: container MAC %q is not Ethernet", veth.Attrs().Name, mac)
	}
	idx := uint32(veth.Attrs().Index)
	want := sourceEntry(ip, mac)
	var have skvSource
	if err := s.objs.SkvSources.Lookup(idx, &have); err != nil || have != want {
		if err := s.objs.SkvSources.Put(idx, want); err != nil {
			return fmt.Errorf("source check entry for %s: %w", veth.Attrs().Name, err)
		}
	}
	return s.attach(veth)
}

// attach puts the program at the head of veth's TCX ingress, through a link
// pinned under the veth's name. A pinned link already running this program
// on this veth is left alone; one running an earlier program is updated in
// place (no gap); one whose veth is gone (a re-created endpoint) is
// replaced.
func (s *sourceCheck) attach(veth netlink.Link) error {
	path := filepath.Join(s.linkDir(), veth.Attrs().Name)
	prog := s.objs.SkvFromContainer
	if old, err := link.LoadPinnedLink(path, nil); err == nil {
		defer old.Close()
		info, err := old.Info()
		if err == nil && info.TCX() != nil && info.TCX().Ifindex == uint32(veth.Attrs().Index) {
			if info.Program == s.progID || old.Update(prog) == nil {
				return nil
			}
		}
		if err := detach(old); err != nil {
			return fmt.Errorf("source check on %s: %w", veth.Attrs().Name, err)
		}
	}
	l, err := link.AttachTCX(link.TCXOptions{Interface: veth.Attrs().Index, Program: prog,
		Attach: ebpf.AttachTCXIngress, Anchor: link.Head()})
	if err != nil {
		return fmt.Errorf("attach source check to %s: %w", veth.Attrs().Name, err)
	}
	defer l.Close()
	if err := l.Pin(path); err != nil {
		return fmt.Errorf("pin source check link of %s: %w", veth.Attrs().Name, err)
	}
	return nil
}

// check reports whether veth is guarded for ip.
func (s *sourceCheck) check(veth netlink.Link, ip netip.Addr) error {
	var have skvSource
	if err := s.objs.SkvSources.Lookup(uint32(veth.Attrs().Index), &have); err != nil {
		return fmt.Errorf("no source check entry for %s: %w", veth.Attrs().Name, err)
	}
	if want := sourceEntry(ip, nil); have.Ip != want.Ip {
		return fmt.Errorf("source check of %s is for another address", veth.Attrs().Name)
	}
	l, err := link.LoadPinnedLink(filepath.Join(s.linkDir(), veth.Attrs().Name), nil)
	if err != nil {
		return fmt.Errorf("no source check on %s: %w", veth.Attrs().Name, err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil || info.TCX() == nil || info.TCX().Ifindex != uint32(veth.Attrs().Index) {
		return fmt.Errorf("source check of %s is not attached to it", veth.Attrs().Name)
	}
	return nil
}

// detach takes a pinned link's program off its device and unpins it. Only
// unpinned, a link would let go of the device later (the kernel puts a
// link whose pin goes from a work queue), and attaching anew at once
// would find the hook taken.
func detach(l link.Link) error {
	if err := l.Detach(); err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
		return err
	}
	return l.Unpin()
}

// unguard detaches the program from the veth called name and removes its
// entry; ifindex 0: the veth is gone, and SyncSources deletes its entry.
func (s *sourceCheck) unguard(name string, ifindex uint32) error {
	var err error
	if l, lerr := link.LoadPinnedLink(filepath.Join(s.linkDir(), name), nil); lerr == nil {
		err = detach(l)
		l.Close()
	} else if !errors.Is(lerr, os.ErrNotExist) {
		err = lerr
	}
	if ifindex != 0 {
		if derr := s.objs.SkvSources.Delete(ifindex); derr != nil && !errors.Is(derr, ebpf.ErrKeyNotExist) {
			err = errors.Join(err, derr)
		}
	}
	return err
}

// SyncSources guards the veth of every endpoint in eps and removes the entries and
// links of veths that are not theirs. An entry already there for the
// endpoint's address keeps its MAC, which AddEndpoint read from the
// container's interface; a new one takes the MAC the store recorded, or,
// without one, the interface's.
func (o *Overlay) SyncSources(eps []cluster.Endpoint) error {
	s := o.src
	if s == nil {
		return errNoSourceCheck
	}
	keepIdx := map[uint32]bool{}
	keepName := map[string]bool{}
	var errs []error
	for _, e := range eps {
		veth, err := netlink.LinkByName(e.Veth)
		if errors.As(err, &netlink.LinkNotFoundError{}) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("host veth %s: %w", e.Veth, err))
			continue
		}
		idx := uint32(veth.Attrs().Index)
		keepIdx[idx], keepName[e.Veth] = true, true
		var have skvSource
		if s.objs.SkvSources.Lookup(idx, &have) == nil && have.Ip == sourceEntry(e.IP.Addr(), nil).Ip {
			errs = append(errs, s.attach(veth))
			continue
		}
		mac, err := net.ParseMAC(e.MAC)
		if err != nil {
			mac, err = containerMAC(e)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		errs = append(errs, s.guard(veth, e.IP.Addr(), mac))
	}
	entries, err := bpfmap.Entries[uint32, skvSource](s.objs.SkvSources)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	var stale []uint32
	for idx := range entries {
		if !keepIdx[idx] {
			stale = append(stale, idx)
		}
	}
	if _, err := bpfmap.Delete(s.objs.SkvSources, stale); err != nil {
		errs = append(errs, err)
	}
	pins, err := os.ReadDir(s.linkDir())
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("source check links: %w", err))...)
	}
	for _, p := range pins {
		if !keepName[p.Name()] {
			errs = append(errs, s.unguard(p.Name(), 0))
		}
	}
	return errors.Join(errs...)
}

// containerMAC reads the MAC of e's interface in its namespace.
func containerMAC(e cluster.Endpoint) (net.HardwareAddr, error) {
	h, done, err := inNetns(e.Netns)
	if err != nil {
		return nil, err
	}
	defer done()
	c, err := h.LinkByName(e.IfName)
	if err != nil {
		return nil, fmt.Errorf("container %s of %s: %w", e.IfName, e.ContainerID, err)
	}
	return c.Attrs().HardwareAddr, nil
}

// SourceDrops returns the source check's drop counters by reason.
func (o *Overlay) SourceDrops() (map[string]uint64, error) {
	if o.src == nil {
		return nil, errNoSourceCheck
	}
	out := make(map[string]uint64, len(SourceReasons))
	for i, name := range SourceReasons {
		var perCPU []uint64
		if err := o.src.objs.SkvDrops.Lookup(uint32(i), &perCPU); err != nil {
			return nil, fmt.Errorf("read source check counter %s: %w", name, err)
		}
		var sum uint64
		for _, v := range perCPU {
			sum += v
		}
		out[name] = sum
	}
	return out, nil
}
