package limits

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/tc"
)

// class is how the programs and the underlay's qdiscs know a class: its
// value in skq_classes, the DSCP (TOS byte) its packets carry, the minor
// of its HTB class and skb->priority on the underlay (priority & 15 is
// also its pfifo_fast band through the default priomap: 6 → band 0,
// 8 → band 1, 2 → band 2), and its share of --underlay-rate.
var classes = map[string]struct {
	value skqSkqClass
	tos   uint8
	minor uint16
	share uint64 // percent
	prio  uint32 // HTB: excess goes to the lowest first
}{
	cluster.ClassHigh:   {skqSkqClassSKQ_HIGH, 0x80, 6, 50, 0}, // CS4
	cluster.ClassNormal: {skqSkqClassSKQ_NORMAL, 0, 8, 35, 1},  // CS0
	cluster.ClassLow:    {skqSkqClassSKQ_LOW, 0x20, 2, 15, 2},  // CS1
}

// QoS marks the underlay packets of containers of the high and low
// classes (qos.c) and, given the underlay's rate, shapes the underlay so
// that under contention each class keeps its share.
type QoS struct {
	objs     skqObjects
	underlay netlink.Link
}

const qosFilter = "skiff-qos"

// LoadQoS loads the marking program with its maps pinned in pinDir and
// attaches it to the underlay's egress.
func LoadQoS(pinDir string, underlay netlink.Link, vxlanPort uint16, log *slog.Logger) (*QoS, error) {
	spec, err := loadSkq()
	if err != nil {
		return nil, fmt.Errorf("read QoS program: %w", err)
	}
	var s skqSpecs
	if err := spec.Assign(&s); err != nil {
		return nil, fmt.Errorf("QoS program: %w", err)
	}
	if err := s.CfgVxlanPort.Set(bpfmap.Port(vxlanPort)); err != nil {
		return nil, err
	}
	q := &QoS{underlay: underlay}
	if err := bpffs.Load(spec, &q.objs, pinDir, log); err != nil {
		return nil, fmt.Errorf("load QoS program: %w", err)
	}
	if err := tc.Attach(&netlink.Handle{}, underlay, tc.Egress, tc.PrioLimits, qosFilter, q.objs.SkqUnderlay); err != nil {
		q.objs.Close()
		return nil, err
	}
	return q, nil
}

// Close releases the process's handles; the program stays attached.
func (q *QoS) Close() error { return q.objs.Close() }

// Sync makes the marked classes those of the local containers given (by
// overlay address; normal ones need no entry).
func (q *QoS) Sync(byAddr map[netip.Addr]string) error {
	have, err := bpfmap.Entries[[4]byte, skqSkqClass](q.objs.SkqClasses)
	if err != nil {
		return err
	}
	var errs []error
	for a, c := range byAddr {
		if v := classes[c].value; v != skqSkqClassSKQ_NORMAL && have[a.As4()] != v {
			errs = append(errs, q.objs.SkqClasses.Put(a.As4(), v))
		}
	}
	for k := range have {
		if c, ok := byAddr[netip.AddrFrom4(k)]; !ok || classes[c].value == skqSkqClassSKQ_NORMAL {
			if err := q.objs.SkqClasses.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// qosCounters names the counters (enum skq_counter, as the BTF has it).
var qosCounters = sync.OnceValue(func() []string { return bpfmap.MustCounterNames(loadSkq, "skq_stats", "SKQ_") })

// Counters are the program's counters by name.
func (q *QoS) Counters() (map[string]uint64, error) {
	return bpfmap.NamedCounters(q.objs.SkqStats, qosCounters())
}

// ShapeUnderlay makes the underlay's root qdisc an HTB of rate bit/s (the
// link's or the path's real bottleneck, which only the administrator
// knows) with one class per QoS class: each is guaranteed its share and
// may borrow up to the whole rate, the higher class first; unmarked
// packets are normal. Rate 0 removes skiff's HTB. Without it, the default
// qdisc (pfifo_fast) still serves the classes' bands in order.
func (q *QoS) ShapeUnderlay(rate uint64) error {
	h := &netlink.Handle{}
	if rate == 0 {
		return Shape(h, q.underlay, 0, 0)
	}
	if ours, err := shapedNoDirect(h, q.underlay, true); err != nil {
		return err
	} else if !ours {
		qdisc := netlink.NewHtb(netlink.QdiscAttrs{LinkIndex: q.underlay.Attrs().Index, Handle: netlink.MakeHandle(handle, 0), Parent: netlink.HANDLE_ROOT})
		qdisc.Defcls = uint32(classes[cluster.ClassNormal].minor)
		qdisc.DirectQlen = &noDirectQueue
		if err := h.QdiscReplace(qdisc); err != nil {
			return fmt.Errorf("HTB on %s: %w", q.underlay.Attrs().Name, err)
		}
	}
	// Classes borrow from their parent only: one class of the whole rate
	// (5c:1) over the three.
	if err := setClass(h, q.underlay, 1, rate, cluster.DefaultBurst(rate)); err != nil {
		return err
	}
	for _, c := range classes {
		if err := setClassUnder(h, q.underlay, 1, c.minor, rate*c.share/100, rate, cluster.DefaultBurst(rate), c.prio); err != nil {
			return err
		}
	}
	return nil
}
