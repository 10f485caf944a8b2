package overlay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/netlinksafe"
	"github.com/skiffnet/skiff/tc"
)

// SourceReasons names the source check's drop counters: enum skv_reason
// (source.h), in its order, as the program's BTF has it.
var SourceReasons = sync.OnceValue(func() []string { return bpfmap.MustCounterNames(loadSkv, "skv_drops", "SKV_") })

// sourceCheck is a host's source check (source.c): skv_from_container,
// first (tc.PrioSource) on every container's host-side veth's ingress, and
// the container's address and MAC in skv_sources under the veth's ifindex.
// The map is pinned in dir and the filters stay with their veths, so the
// check outlives the agent. A clsact filter, not a TCX link: attaching a
// TCX program waits for an RCU grace period (7-20 ms here), which made CNI
// ADD 2.4 times slower; a filter takes a fraction of a millisecond.
type sourceCheck struct {
	objs    skvObjects
	progID  int
	checked time.Time // when SyncSources last checked every filter
}

// sourceFilter names the source check's filters.
const sourceFilter = "skiff-source"

func loadSourceCheck(dir string, log *slog.Logger) (*sourceCheck, error) {
	spec, err := loadSkv()
	if err != nil {
		return nil, fmt.Errorf("read source check: %w", err)
	}
	s := &sourceCheck{}
	if err := bpffs.Load(spec, &s.objs, dir, log); err != nil {
		return nil, fmt.Errorf("load source check: %w", err)
	}
	info, err := s.objs.SkvFromContainer.Info()
	var id ebpf.ProgramID
	if err == nil {
		id, _ = info.ID()
	}
	if err != nil || id == 0 {
		s.objs.Close()
		return nil, fmt.Errorf("source check: no program id (%v)", err)
	}
	s.progID = int(id)
	return s, nil
}

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

// attach puts the program first on veth's ingress. A filter already running
// this program is left alone; one running an earlier program (an agent
// restarted) is replaced in place, without a gap.
func (s *sourceCheck) attach(veth netlink.Link) error {
	h := &netlink.Handle{}
	if ok, err := tc.Attached(h, veth, tc.Ingress, tc.PrioSource, sourceFilter, s.progID); err != nil || ok {
		return err
	}
	return tc.Attach(h, veth, tc.Ingress, tc.PrioSource, sourceFilter, s.objs.SkvFromContainer)
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
	ok, err := tc.Attached(&netlink.Handle{}, veth, tc.Ingress, tc.PrioSource, sourceFilter, s.progID)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("no source check on %s", veth.Attrs().Name)
	}
	return nil
}

// unguard takes the program off the veth with ifindex (if it still exists)
// and removes its entry.
func (s *sourceCheck) unguard(ifindex uint32) error {
	var err error
	if l, lerr := netlink.LinkByIndex(int(ifindex)); lerr == nil {
		err = tc.Detach(&netlink.Handle{}, l, tc.Ingress, sourceFilter)
	}
	if derr := s.objs.SkvSources.Delete(ifindex); derr != nil && !errors.Is(derr, ebpf.ErrKeyNotExist) {
		err = errors.Join(err, derr)
	}
	return err
}

// sourceRecheck is how often SyncSources looks at every guarded veth's
// filter (one netlink dump each): a reconcile runs on every endpoint
// change, and CNI ADDs wait for it.
const sourceRecheck = 10 * time.Second

// SyncSources guards the veth of every endpoint in eps and removes the
// entries and filters of veths that are not theirs. A veth with its entry
// has its filter checked (and replaced when missing or an earlier agent's)
// at the first call and then every sourceRecheck. An entry already there for the
// endpoint's address keeps its MAC, which AddEndpoint read from the
// container's interface; a new one takes the MAC the store recorded, or,
// without one, the interface's.
func (o *Overlay) SyncSources(eps []cluster.Endpoint) error {
	s := o.src
	if s == nil {
		return errNoSourceCheck
	}
	links, err := netlinksafe.Dump(netlink.LinkList)
	if err != nil {
		return fmt.Errorf("list links: %w", err)
	}
	byName := make(map[string]netlink.Link, len(links))
	for _, l := range links {
		byName[l.Attrs().Name] = l
	}
	full := time.Since(s.checked) >= sourceRecheck
	keep := map[uint32]bool{}
	var errs []error
	for _, e := range eps {
		veth, ok := byName[e.Veth]
		if !ok {
			continue
		}
		idx := uint32(veth.Attrs().Index)
		keep[idx] = true
		var have skvSource
		if s.objs.SkvSources.Lookup(idx, &have) == nil && have.Ip == sourceEntry(e.IP.Addr(), nil).Ip {
			if full {
				errs = append(errs, s.attach(veth))
			}
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
	for idx := range entries {
		if !keep[idx] {
			errs = append(errs, s.unguard(idx))
		}
	}
	err = errors.Join(errs...)
	if full && err == nil {
		s.checked = time.Now()
	}
	return err
}

// containerMAC reads the MAC of e's interface in its namespace.
func containerMAC(e cluster.Endpoint) (net.HardwareAddr, error) {
	h, _, done, err := inNetns(e)
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
	return bpfmap.NamedCounters(o.src.objs.SkvDrops, SourceReasons())
}
