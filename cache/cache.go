// Package cache is skiff's cache layer: the ONCache fast path (NSDI '25) in
// front of the standard overlay. Its eBPF programs (cache.c) carry
// established cross-host flows past conntrack, netfilter, the bridge and the
// VXLAN device; this file loads them, attaches them with tc and keeps their
// caches coherent with the cluster: entries of deleted endpoints, departed
// hosts and newly denied flows are purged (delete-and-reinitialize, paper
// §3.4), and anything the caches cannot answer falls back to the overlay.
package cache

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/policymap"
)

// Capacity sets the number of entries of each cache (LRU maps) and of the
// connection table (a full table sends new connections to the overlay).
type Capacity struct {
	EgressIPs   uint32 // remote container → host
	EgressHosts uint32 // remote host → outer headers
	Ingress     uint32 // local container → MACs and veth
	Filter      uint32 // flows allowed in each direction
	Connections uint32 // TCP connections the fast path owns from their SYN
}

// DefaultCapacity fits every address of a /16 cluster network (the
// agent preloads every remote container's), 1 024 remote hosts, 1 024
// local containers and 65 536 connections (docs/maps.md).
var DefaultCapacity = Capacity{EgressIPs: 65536, EgressHosts: 1024, Ingress: 1024, Filter: 16384, Connections: 65536}

// config describes the host the cache runs on.
type config struct {
	Cluster  cluster.Config
	Host     cluster.Host
	Underlay string // underlay device
	PinDir   string // bpffs directory for the maps
	Capacity Capacity
	Tunnel   string // TunnelVXLAN (""), or TunnelRewrite
}

// fastPath is the loaded fast path of one host.
type fastPath struct {
	cfg      config
	objs     skcObjects
	underlay netlink.Link
	log      *slog.Logger
	ctl      skcControl     // what skc_control holds
	policy   policymap.Maps // the policy the table's SYNs are judged by
	unloaded int            // remote addresses the last Sync left out of skc_egress_ip (no room)
	remote   struct {       // the remote hosts, for refreshHeaders
		sync.Mutex
		hosts []cluster.Host
	}
}

// load loads the programs with this host's configuration. Maps pinned in
// cfg.PinDir by an earlier run are reused, so a restarting agent keeps the
// warm caches; maps whose definition changed are replaced by empty ones.
func load(cfg config, log *slog.Logger) (*fastPath, error) {
	under, err := netlink.LinkByName(cfg.Underlay)
	if err != nil {
		return nil, fmt.Errorf("underlay %q: %w", cfg.Underlay, err)
	}
	return loadOn(cfg, under, log)
}

// loadOn is load on a given underlay device.
func loadOn(cfg config, under netlink.Link, log *slog.Logger) (*fastPath, error) {
	if cfg.Capacity == (Capacity{}) {
		cfg.Capacity = DefaultCapacity
	}
	spec, err := loadSkc()
	if err != nil {
		return nil, fmt.Errorf("read cache programs: %w", err)
	}
	if err := configure(spec, cfg, under); err != nil {
		return nil, err
	}
	c := &fastPath{cfg: cfg, underlay: under, log: log}
	if err := bpffs.Load(spec, &c.objs, cfg.PinDir, log); err != nil {
		return nil, fmt.Errorf("load cache programs: %w", err)
	}
	// The policy maps are this process's (not pinned): no SYN opens a
	// connection until they hold the policy. Learning stays paused if an
	// earlier run left it so, until the first Settle.
	if err := c.objs.SkcControl.Lookup(uint32(0), &c.ctl); err != nil {
		c.Close()
		return nil, fmt.Errorf("read cache control: %w", err)
	}
	c.policy = policymap.Maps{Egress: c.objs.SkpEgress, Ingress: c.objs.SkpIngress, Verdicts: c.objs.SkpVerdicts}
	if err := c.setPolicy(false); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// configure sizes spec's caches and sets the programs' configuration
// constants for this host.
func configure(spec *ebpf.CollectionSpec, cfg config, under netlink.Link) error {
	var s skcSpecs
	if err := spec.Assign(&s); err != nil {
		return fmt.Errorf("cache programs: %w", err)
	}
	be32 := func(a netip.Addr) [4]byte { return a.As4() }
	mask := func(p netip.Prefix) [4]byte {
		m := net.CIDRMask(p.Bits(), 32)
		return [4]byte{m[0], m[1], m[2], m[3]}
	}
	var mac [6]byte
	copy(mac[:], under.Attrs().HardwareAddr)
	lo, hi, err := localPortRange()
	if err != nil {
		return err
	}
	port := uint16(cfg.Cluster.VXLANPort)
	for _, m := range []struct {
		spec *ebpf.MapSpec
		n    uint32
	}{
		{s.SkcEgressIp, cfg.Capacity.EgressIPs}, {s.SkcEgressHost, cfg.Capacity.EgressHosts},
		{s.SkcIngress, cfg.Capacity.Ingress}, {s.SkcFilter, cfg.Capacity.Filter},
		{s.SkcFlows, cfg.Capacity.Connections},
	} {
		if m.n == 0 {
			return fmt.Errorf("capacity of %s is 0", m.spec.Name)
		}
		m.spec.MaxEntries = m.n
	}
	return errors.Join(
		s.CfgClusterNet.Set(be32(cfg.Cluster.CIDR.Masked().Addr())),
		s.CfgClusterMask.Set(mask(cfg.Cluster.CIDR)),
		s.CfgLocalNet.Set(be32(cfg.Host.Subnet.Masked().Addr())),
		s.CfgLocalMask.Set(mask(cfg.Host.Subnet)),
		s.CfgUnderlayIp.Set(be32(cfg.Host.UnderlayIP)),
		s.CfgUnderlayMac.Set(mac),
		s.CfgVxlanPort.Set([2]byte{byte(port >> 8), byte(port)}),
		s.CfgVni.Set(uint32(cfg.Cluster.VNI)),
		s.CfgPortMin.Set(lo),
		s.CfgPortMax.Set(hi),
		s.CfgRewrite.Set(b32(cfg.Tunnel == TunnelRewrite)),
		s.CfgVxlanMax.Set(uint32(under.Attrs().MTU-overlay.Overhead)),
	)
}

// localPortRange is the UDP source port range the overlay's VXLAN device
// uses (it has no range of its own configured): the namespace's local port range.
func localPortRange() (uint32, uint32, error) {
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, 0, fmt.Errorf("local port range: %w", err)
	}
	f := strings.Fields(string(data))
	if len(f) != 2 {
		return 0, 0, fmt.Errorf("local port range %q", data)
	}
	lo, err1 := strconv.ParseUint(f[0], 10, 16)
	hi, err2 := strconv.ParseUint(f[1], 10, 16)
	if err := errors.Join(err1, err2); err != nil {
		return 0, 0, fmt.Errorf("local port range %q: %w", data, err)
	}
	return uint32(lo), uint32(hi), nil
}

// Close releases this process's handles; pinned maps and attached programs
// stay, so the fast path keeps running without the agent.
func (c *fastPath) Close() error { return c.objs.Close() }

// SetPaused stops (or restarts) learning in the init programs and the
// opening of table connections. Packets keep flowing on both paths while
// paused; only new cache entries wait.
func (c *fastPath) SetPaused(paused bool) error {
	c.ctl.Paused = b32(paused)
	if err := c.objs.SkcControl.Put(uint32(0), c.ctl); err != nil {
		return fmt.Errorf("set cache learning paused=%v: %w", paused, err)
	}
	return nil
}

// setPolicy says whether policymap's maps hold the current policy, so
// that SYNs may open table connections.
func (c *fastPath) setPolicy(valid bool) error {
	c.ctl.Policy = b32(valid)
	if err := c.objs.SkcControl.Put(uint32(0), c.ctl); err != nil {
		return fmt.Errorf("set cache policy valid=%v: %w", valid, err)
	}
	return nil
}

func b32(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}
