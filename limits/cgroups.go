package limits

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
)

// Cgroups enforces limits on containers' cgroups (limits.c), for the
// paths that pass no skiff qdisc: host sockets. The layer that gives a
// container such a path attaches Programs to its cgroup and calls Set.
type Cgroups struct {
	// mu makes Set and Forget one at a time: both read which ingress
	// classes are in use (freeClass, unclassify) before they change them,
	// and the agent adds and removes containers at once.
	mu       sync.Mutex
	objs     sklObjects
	underlay string // host sockets receive on it and on lo
}

// Headroom is how far above a limit the cgroup buckets let a container
// go: its container-namespace traffic, shaped to the limit by HTB, passes
// them untouched.
const Headroom = 1.05

// LoadCgroups loads the programs, with their maps pinned in pinDir
// (skl_*: reused by a restart, so limits hold across it). hostNetns is the
// host namespace's cookie (only host sockets are paced); underlay is the
// device host sockets receive on.
func LoadCgroups(pinDir string, hostNetns uint64, underlay string, log *slog.Logger) (*Cgroups, error) {
	spec, err := loadSkl()
	if err != nil {
		return nil, fmt.Errorf("read limit programs: %w", err)
	}
	var s sklSpecs
	if err := spec.Assign(&s); err != nil {
		return nil, fmt.Errorf("limit programs: %w", err)
	}
	if err := s.CfgHostNetns.Set(hostNetns); err != nil {
		return nil, err
	}
	c := &Cgroups{underlay: underlay}
	if err := bpffs.Load(spec, &c.objs, pinDir, log); err != nil {
		return nil, fmt.Errorf("load limit programs: %w", err)
	}
	return c, nil
}

// Close releases the process's handles; pins and links stay.
func (c *Cgroups) Close() error { return c.objs.Close() }

// Program is one program of a container's cgroup, with its attach type.
type Program struct {
	Prog   *ebpf.Program
	Attach ebpf.AttachType
}

// Programs are what a limited container's cgroup runs, by pin name.
func (c *Cgroups) Programs() map[string]Program {
	return map[string]Program{
		"skl_egress":  {c.objs.SklEgress, ebpf.AttachCGroupInetEgress},
		"skl_ingress": {c.objs.SklIngress, ebpf.AttachCGroupInetIngress},
		"skl_sockops": {c.objs.SklSockops, ebpf.AttachCGroupSockOps},
	}
}

// entry is l as the programs apply it to cgroup traffic: bytes, with the
// headroom, and a burst of at least 20 ms at the rate egress, 100 ms
// ingress (a backstop behind the IFB's shaping); pace is the egress rate
// itself. The ingress class is Set's.
func entry(l cluster.Limit) sklSklLimit {
	var e sklSklLimit
	for i, d := range []struct{ rate, burst, perSec uint64 }{{l.EgressRate, l.EgressBurst, 50}, {l.IngressRate, l.IngressBurst, 10}} {
		if d.rate == 0 {
			continue
		}
		rate := uint64(float64(d.rate) * Headroom / 8)
		e.Rate[i], e.Burst[i] = rate, max(d.burst/8, rate/d.perSec) // at least 1/perSec s
	}
	e.Pace = math.MaxUint32 // ~0U: not paced
	if p := l.EgressRate / 8; p > 0 && p < math.MaxUint32 {
		e.Pace = uint32(p)
	}
	if l.Marks() {
		c := classes[l.Class]
		e.Tos, e.Priority = uint32(c.tos), uint32(handle)<<16|uint32(c.minor)
	}
	return e
}

// Set puts limit l in force for the cgroup id and paces its established
// host connections to it; a zero limit lifts it. Attach Programs before.
func (c *Cgroups) Set(id uint64, l cluster.Limit) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var cur sklSklLimit
	found := c.objs.SklLimits.Lookup(id, &cur) == nil
	want := entry(l)
	want.Class = cur.Class
	if found && cur == want {
		return nil
	}
	class, err := c.shapeIngress(cur.Class, l.IngressRate, l.IngressBurst)
	if err != nil {
		return err
	}
	want.Class = class
	if err := c.objs.SklLimits.Put(id, want); err != nil {
		return fmt.Errorf("limit of cgroup %d: %w", id, err)
	}
	if !found {
		cur = entry(cluster.Limit{}) // what a socket of an unlimited cgroup has
	}
	// Established host sockets follow a changed pacing rate or class.
	if onSockets(cur) != onSockets(want) {
		if err := c.pace(); err != nil {
			return err
		}
	}
	if l.None() && !l.Marks() {
		return c.forget(id)
	}
	if cur.Class != 0 && class == 0 {
		return c.unclassify() // perhaps the last ingress class went
	}
	return nil
}

// onSockets is what of an entry skl_pace sets on host sockets.
func onSockets(e sklSklLimit) [3]uint32 { return [3]uint32{e.Pace, e.Tos, e.Priority} }

// Forget removes what the maps and the IFB hold for a cgroup.
func (c *Cgroups) Forget(id uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.forget(id)
}

func (c *Cgroups) forget(id uint64) error {
	var errs []error
	var cur sklSklLimit
	if c.objs.SklLimits.Lookup(id, &cur) == nil {
		_, err := c.shapeIngress(cur.Class, 0, 0)
		errs = append(errs, err)
	}
	for _, m := range []*ebpf.Map{c.objs.SklLimits, c.objs.SklBuckets} {
		if err := m.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(append(errs, c.unclassify())...)
}

// pace runs skl_pace over the host's TCP sockets (the agent's namespace).
func (c *Cgroups) pace() error {
	_, err := bpfmap.Iterate(c.objs.SklPace)
	return err
}

// cgroupsCounters names the counters (enum skl_counter, as the BTF has it).
var cgroupsCounters = sync.OnceValue(func() []string { return bpfmap.MustCounterNames(loadSkl, "skl_stats", "SKL_") })

// Counters are the program's counters by name.
func (c *Cgroups) Counters() (map[string]uint64, error) {
	return bpfmap.NamedCounters(c.objs.SklStats, cgroupsCounters())
}
