// Package sockets is skiff's sockets layer: containers' TCP connections run
// on host sockets (Slim, NSDI '19; SlimFast), so their packets cross one
// network stack with no encapsulation, no veth and no bridge. Connection
// setup stays in the kernel: eBPF cgroup hooks rewrite connect and bind,
// sockops carries the overlay addresses in a SYN option, and sk_lookup
// steers the SYN to the container's listener (sockets.c). A per-container
// broker (shim/) hands host sockets to the container's processes, where the
// LD_PRELOAD shim puts them in place of socket(); whatever the fast path
// cannot carry falls back to the overlay.
//
// This file loads the programs; attach.go attaches them, sync.go keeps their
// maps coherent with the cluster and iter.go lists and ends replaced
// connections.
package sockets

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"path/filepath"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/limits"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/sockets/broker"
)

// Config describes the host the layer runs on.
type Config struct {
	Cluster    cluster.Config
	Host       cluster.Host
	Underlay   string // underlay device
	PinDir     string // bpffs directory for maps and links
	Secure     bool   // refuse what the fast path does not carry (default on)
	CgroupRoot string // cgroup v2 mount containers' cgroups are relative to
	Broker     string // the skiff-broker binary
	StateDir   string // brokers' statistics files
	// ListenerQuota is how many ports one container's host sockets may
	// hold, bound or listening (0: DefaultListenerQuota).
	ListenerQuota int
}

// DefaultListenerQuota is a container's share of the host's replaced
// listeners (sks_listen and sks_bound hold 16 384 each): past it, a
// container's listeners are its own sockets, reached through the overlay.
const DefaultListenerQuota = 256

// dataPlane is the loaded sockets layer of one host.
type dataPlane struct {
	cfg      Config
	objs     sksObjects
	underlay netlink.Link
	log      *slog.Logger
	brokers  *broker.Supervisor
	limits   *limits.Cgroups // rate limits of host sockets
	// rulesSpec makes the inner maps of sks_policy; policy is what the
	// current one holds (nil: unknown, rewritten at the next Sync).
	rulesSpec *ebpf.MapSpec
	policy    *sksSksRules
	// routesOver is how many published listeners the last Sync left
	// without a route (sks_routes full).
	routesOver atomic.Int64
}

// load loads the programs with this host's configuration. Maps pinned by an
// earlier run are reused, so replaced connections keep their overlay
// identity across agent restarts.
func load(cfg Config, log *slog.Logger) (*dataPlane, error) {
	under, err := netlink.LinkByName(cfg.Underlay)
	if err != nil {
		return nil, fmt.Errorf("underlay %q: %w", cfg.Underlay, err)
	}
	spec, err := loadSks()
	if err != nil {
		return nil, fmt.Errorf("read sockets programs: %w", err)
	}
	var s sksSpecs
	if err := spec.Assign(&s); err != nil {
		return nil, fmt.Errorf("sockets programs: %w", err)
	}
	cookie, err := overlay.NetnsCookie()
	if err != nil {
		return nil, err
	}
	if err := configure(s.sksVariableSpecs, cfg, cookie); err != nil {
		return nil, err
	}
	l := &dataPlane{cfg: cfg, underlay: under, log: log, rulesSpec: s.SksPolicy.InnerMap.Copy()}
	if err := bpffs.Load(spec, &l.objs, cfg.PinDir, log); err != nil {
		return nil, fmt.Errorf("load sockets programs: %w", err)
	}
	if l.limits, err = limits.LoadCgroups(cfg.PinDir, cookie, cfg.Underlay, log); err != nil {
		l.objs.Close()
		return nil, err
	}
	l.brokers = broker.New(broker.Config{Binary: cfg.Broker, StateDir: cfg.StateDir, CIDR: cfg.Cluster.CIDR, Secure: cfg.Secure, CgroupRoot: cfg.CgroupRoot, OpenNetns: overlay.OpenNetns}, log)
	return l, nil
}

// configure sets the programs' configuration constants for this host.
func configure(v sksVariableSpecs, cfg Config, cookie uint64) error {
	secure := uint32(0)
	if cfg.Secure {
		secure = 1
	}
	return errors.Join(
		v.CfgHostNetns.Set(cookie),
		v.CfgClusterNet.Set(cfg.Cluster.CIDR.Masked().Addr().As4()),
		v.CfgClusterMask.Set(mask(cfg.Cluster.CIDR)),
		v.CfgLocalNet.Set(cfg.Host.Subnet.Masked().Addr().As4()),
		v.CfgLocalMask.Set(mask(cfg.Host.Subnet)),
		v.CfgSecure.Set(secure),
		v.CfgMark.Set(uint32(Mark)),
		v.CfgTrackedMark.Set(uint32(TrackedMark)),
		v.CfgTos.Set(uint8(HostStackTOS)),
		v.CfgSameHost.Set(SameHostAddr.As4()),
		v.CfgListenQuota.Set(uint32(cfg.quota())),
	)
}

func (c Config) quota() int {
	if c.ListenerQuota <= 0 {
		return DefaultListenerQuota
	}
	return c.ListenerQuota
}

func mask(p netip.Prefix) [4]byte {
	m := net.CIDRMask(p.Bits(), 32)
	return [4]byte{m[0], m[1], m[2], m[3]}
}

// Mark tags overlay packets the layer sends to the host stack, for the
// overlay's policy on INPUT (HostStackTOS routes them there).
const Mark = 0x5c1ff

// TrackedMark tags the packets the layer turns back from the bridge into
// the host stack: conntrack saw them on their way out, and a raw rule
// (notrackRule) keeps it from tracking them again on lo (steer.h,
// sks_to_container).
const TrackedMark = 0x5c1fe

// notrackRule is the raw table's PREROUTING rule for TrackedMark. The mark
// is its only match, as for the policy's INPUT rule.
var notrackRule = []string{"-m", "mark", "--mark", fmt.Sprintf("%#x", TrackedMark), "-m", "comment", "--comment",
	"skiff: tracked on the way out", "-j", "CT", "--notrack"}

// pinned reports whether a sockets layer is pinned in dir.
func pinned(dir string) bool {
	m, err := ebpf.LoadPinnedMap(filepath.Join(dir, "sks_listen"), nil)
	if err != nil {
		return false
	}
	m.Close()
	return true
}

// Close releases this process's handles and stops the broker supervisor;
// pinned maps, attached programs and running brokers stay.
func (l *dataPlane) Close() error {
	l.brokers.Close()
	return errors.Join(l.objs.Close(), l.limits.Close())
}

// Reasons names the counters: enum sks_reason (sockets.h), in its order,
// as the programs' BTF has it.
var Reasons = sync.OnceValue(func() []string { return bpfmap.MustCounterNames(loadSks, "sks_stats", "SKS_") })

// Stats returns the counters summed over CPUs, by reason.
func (l *dataPlane) Stats() (map[string]uint64, error) {
	out, err := bpfmap.NamedCounters(l.objs.SksStats, Reasons())
	if err != nil {
		return nil, err
	}
	lc, err := l.limits.Counters()
	for name, v := range lc {
		out["limit_"+name] = v
	}
	return out, err
}

// BrokerRunning reports whether the container's broker runs.
func (l *dataPlane) BrokerRunning(containerID string) bool { return l.brokers.Running(containerID) > 0 }
