package limits

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/tc"
)

// Police holds the egress policer of limited containers (police.c): the
// host side of their limit, which a container cannot send around.
type Police struct{ objs skrObjects }

const policeFilter = "skiff-police"

// policeHeadroom is how far above a limit the policer lets traffic
// through: what the container's HTB shaped passes untouched; what went
// around it is held near the limit.
const policeHeadroom = 1.05

// LoadPolice loads the policer with its maps pinned in pinDir.
func LoadPolice(pinDir string, log *slog.Logger) (*Police, error) {
	spec, err := loadSkr()
	if err != nil {
		return nil, fmt.Errorf("read the policer: %w", err)
	}
	p := &Police{}
	if err := bpffs.Load(spec, &p.objs, pinDir, log); err != nil {
		return nil, fmt.Errorf("load the policer: %w", err)
	}
	return p, nil
}

// Close releases the process's handles; attached policers stay.
func (p *Police) Close() error { return p.objs.Close() }

// Set polices what the host veth receives (the container's egress) to
// rate bit/s with bursts of burst bits, a little above both; rate 0
// removes the policer. Changing a rate keeps the bucket's tokens.
func (p *Police) Set(h *netlink.Handle, veth netlink.Link, rate, burst uint64) error {
	key := uint32(veth.Attrs().Index)
	if rate == 0 {
		err := tc.Detach(h, veth, tc.Ingress, policeFilter)
		if derr := p.objs.SkrPolicers.Delete(key); derr != nil && !errors.Is(derr, ebpf.ErrKeyNotExist) {
			err = errors.Join(err, derr)
		}
		return err
	}
	want := skrSkrPolicer{
		Rate:  uint64(float64(rate) / 8 * policeHeadroom),
		Burst: uint64(float64(max(burst, cluster.MinBurst)) / 8 * 1.5),
	}
	var have skrSkrPolicer
	if err := p.objs.SkrPolicers.Lookup(key, &have); err == nil && have.Rate == want.Rate && have.Burst == want.Burst {
		// Unchanged: keep the program's tokens and clock.
	} else if err := p.objs.SkrPolicers.Put(key, want); err != nil {
		return fmt.Errorf("policer of %s: %w", veth.Attrs().Name, err)
	}
	return tc.Attach(h, veth, tc.Ingress, tc.PrioPolice, policeFilter, p.objs.SkrPolice)
}

// policeCounters names the counters (enum skr_counter, as the BTF has it).
var policeCounters = sync.OnceValue(func() []string { return bpfmap.MustCounterNames(loadSkr, "skr_stats", "SKR_") })

// Counters are the program's counters by name.
func (p *Police) Counters() (map[string]uint64, error) {
	return bpfmap.NamedCounters(p.objs.SkrStats, policeCounters())
}

// Forget deletes the policer of a host veth that went (by its index: a
// later device may get the index).
func (p *Police) Forget(ifindex uint32) error {
	if err := p.objs.SkrPolicers.Delete(ifindex); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("forget the policer of device %d: %w", ifindex, err)
	}
	return nil
}

// Prune deletes the policers of every host veth but those in keep (by
// index): what containers deleted while the agent was down left.
func (p *Police) Prune(keep map[uint32]bool) error {
	have, err := bpfmap.Entries[uint32, skrSkrPolicer](p.objs.SkrPolicers)
	if err != nil {
		return err
	}
	var stale []uint32
	for k := range have {
		if !keep[k] {
			stale = append(stale, k)
		}
	}
	_, err = bpfmap.Delete(p.objs.SkrPolicers, stale)
	return err
}
