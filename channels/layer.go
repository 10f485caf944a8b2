// Package channels is skiff's channels layer: same-host fast channels
// (channels.c). Two containers of one host that talk TCP have what one
// sends queued on the other's socket, past both stacks, the veths and the
// bridge. docs/channels.md.
package channels

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/limits"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/policy"
)

func init() {
	layer.Register(layer.Registration{Name: "channels", Probe: probe, With: with, New: newLayer, Teardown: teardown, Flags: flags})
}

// flags: --channels-capacity, --channels-containers (by default on when
// the layer is named, by --mode channels or --layers, off in auto); the
// cgroup root is skiffd's --cgroup-root.
func flags(fs *flag.FlagSet) layer.FlagOptions {
	var o Options
	fs.IntVar(&o.Capacity, "channels-capacity", DefaultCapacity, "channels layer: sockets its map holds (two a connection); connections past it stay on TCP")
	fs.BoolVar(&o.Containers, "channels-containers", false, "channels layer: join the sockets of containers' own namespaces too, not only host sockets (default: on when the layer is named by --mode or --layers, off in auto; docs/channels.md)")
	return func(s layer.Settings) (any, error) {
		if !layer.IsSet(fs, "channels-containers") {
			o.Containers = s.Mode != layer.Auto
		}
		o.CgroupRoot = s.CgroupRoot
		return o, nil
	}
}

// with: a layer for host sockets alone serves the sockets layer.
func with(options any) []string {
	if o, ok := options.(Options); ok && o.Containers {
		return nil
	}
	return []string{"sockets"}
}

// probe checks for sockops, sk_msg redirects into a socket hash, socket
// storage, ending sockets from an iterator, and cgroup v2 (sockops hooks
// on its root).
func probe(any) error {
	return layer.First(
		layer.Programs(ebpf.SockOps),
		layer.Programs(ebpf.SkMsg, asm.FnMsgRedirectHash),
		layer.Maps(ebpf.SockHash, ebpf.SkStorage, ebpf.LRUHash),
		layer.KernelHas("bpf_sock_destroy, to end connections the policy denies", "bpf_sock_destroy"),
		func() error { _, err := cgroup.Root(); return err },
	)
}

// Options are the layer's (skiffd --channels-capacity,
// --channels-containers).
type Options struct {
	// Capacity is how many sockets the channel map holds (two a
	// connection); past it, connections stay on TCP. 0: DefaultCapacity.
	Capacity int
	// Containers joins the sockets of containers' own namespaces too, not
	// only the sockets layer's host sockets. A blocking read on a
	// channelled socket can fail with EAGAIN on this kernel; the sockets
	// layer's shim retries it, a program without the shim may not
	// (docs/channels.md).
	Containers bool
	// CgroupRoot is the cgroup v2 mount containers' cgroups are under
	// (skiffd --cgroup-root; default: found or mounted, cgroup.Root).
	CgroupRoot string
}

// DefaultCapacity is the channel map's size by default.
const DefaultCapacity = 65536

// Layer is the channels layer as the agent drives it.
type Layer struct {
	opts Options
	root string // cgroup v2 mount
	objs skchObjects
	log  *slog.Logger
	eps  layer.Attached
}

// newLayer takes Options (nil: the defaults).
func newLayer(options any) (layer.Layer, error) {
	o := Options{Capacity: DefaultCapacity}
	switch v := options.(type) {
	case nil:
	case Options:
		if v.Capacity < 0 || v.Capacity > 1<<24 {
			return nil, fmt.Errorf("channels capacity %d: want 0 to %d", v.Capacity, 1<<24)
		}
		o = v
		o.Capacity = cmp.Or(v.Capacity, DefaultCapacity)
	default:
		return nil, fmt.Errorf("channels layer options are channels.Options, not %T", options)
	}
	return &Layer{opts: o}, nil
}

const sockopsLink = "skch_link_sockops"

// Start loads the programs (maps pinned: channels of connections that
// outlive the agent keep working), puts skch_msg on the socket hash and
// skch_sockops on the cgroup v2 root.
func (l *Layer) Start(_ context.Context, env layer.Env) error {
	l.log = env.Log
	spec, err := loadSkch()
	if err != nil {
		return fmt.Errorf("read channels programs: %w", err)
	}
	for _, m := range []string{"skch_socks", "skch_owners"} {
		spec.Maps[m].MaxEntries = uint32(l.opts.Capacity)
	}
	host, err := overlay.NetnsCookie()
	if err != nil {
		return err
	}
	if err := spec.Variables["cfg_host_netns"].Set(host); err != nil {
		return fmt.Errorf("configure channels programs: %w", err)
	}
	if l.root = l.opts.CgroupRoot; l.root == "" {
		if l.root, err = cgroup.Root(); err != nil {
			return err
		}
	}
	if err := bpffs.Load(spec, &l.objs, env.PinDir, env.Log); err != nil {
		return fmt.Errorf("load channels programs: %w", err)
	}
	if !l.opts.Containers {
		// An earlier run joined containers' own sockets: not this one.
		all, err := bpfmap.Entries[uint64, uint32](l.objs.SkchNetns)
		if err == nil {
			_, err = bpfmap.Delete(l.objs.SkchNetns, slices.Collect(maps.Keys(all)))
		}
		if err != nil {
			return fmt.Errorf("forget containers' namespaces: %w", err)
		}
	}
	// Attaching replaces the program an earlier run put there.
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{Target: l.objs.SkchSocks.FD(), Program: l.objs.SkchMsg,
		Attach: ebpf.AttachSkMsgVerdict}); err != nil {
		return fmt.Errorf("attach skch_msg: %w", err)
	}
	for name, p := range map[string]limits.Program{
		sockopsLink:            {Prog: l.objs.SkchSockops, Attach: ebpf.AttachCGroupSockOps},
		"skch_link_setsockopt": {Prog: l.objs.SkchSetsockopt, Attach: ebpf.AttachCGroupSetsockopt},
	} {
		if err := pinnedLink(filepath.Join(env.PinDir, name), l.root, p.Prog, p.Attach); err != nil {
			return err
		}
	}
	return nil
}

// pinnedLink attaches prog to the cgroup root with a link pinned at path,
// or updates the link an earlier run pinned there.
func pinnedLink(path, root string, prog *ebpf.Program, attach ebpf.AttachType) error {
	return bpffs.PinLink(path, prog, func() (link.Link, error) {
		return link.AttachCgroup(link.CgroupOptions{Path: root, Attach: attach, Program: prog})
	})
}

// teardown removes an earlier run's programs and maps: the sockops link
// (so no new socket joins) and the pins (channelled connections end with
// the map, when its last socket closes).
func teardown(env layer.Env, _ any) (bool, error) {
	path := filepath.Join(env.PinDir, sockopsLink)
	if _, err := os.Stat(path); err != nil {
		return false, nil
	}
	return true, bpffs.Unpin(env.PinDir, "skch_")
}

// errLimited is why a rate-limited container takes no channel.
var errLimited = errors.New("rate limited: a channel would skip the limit")

// attach registers a local container: its host sockets (by its cgroup,
// when it has one) and, with Options.Containers, the sockets of its
// namespace with its address join the channels. A rate-limited
// container's are taken out, and its channelled connections fall back to
// TCP at their next write.
func (l *Layer) attach(e cluster.Endpoint) error {
	ip := bpfmap.IPv4(e.IP.Addr())
	if !e.Limit.None() {
		err := l.forget(func(a netip.Addr) bool { return a == e.IP.Addr() })
		if derr := l.objs.SkchIps.Delete(ip); derr != nil && !errors.Is(derr, ebpf.ErrKeyNotExist) {
			err = errors.Join(err, derr)
		}
		return errors.Join(errLimited, err)
	}
	if e.Cgroup != "" {
		dir, err := cgroup.Dir(l.root, e)
		if err != nil {
			return err
		}
		id, err := cgroup.ID(dir)
		if err != nil {
			return err
		}
		if err := l.objs.SkchCgroups.Put(id, ip); err != nil {
			return fmt.Errorf("register the cgroup of %s: %w", e.ContainerID, err)
		}
	}
	if l.opts.Containers {
		var cookie uint64
		if err := overlay.InNetns(e, func() (err error) { cookie, err = overlay.NetnsCookie(); return err }); err != nil {
			return err
		}
		if err := l.objs.SkchNetns.Put(cookie, ip); err != nil {
			return fmt.Errorf("register the namespace of %s: %w", e.ContainerID, err)
		}
	}
	return l.objs.SkchIps.Put(ip, uint8(1))
}

func (l *Layer) AddEndpoint(_ context.Context, e cluster.Endpoint) error {
	return l.eps.Add(e, l.attach)
}

// RemoveEndpoint forgets a container's namespace (its sockets leave the
// channels when they close, as the namespace goes).
func (l *Layer) RemoveEndpoint(_ context.Context, e cluster.Endpoint) error {
	l.eps.Remove(e)
	return l.forget(func(ip netip.Addr) bool { return ip == e.IP.Addr() })
}

// forget deletes the namespaces, cgroups and addresses gone says.
func (l *Layer) forget(gone func(netip.Addr) bool) error {
	var errs []error
	for _, m := range []*ebpf.Map{l.objs.SkchNetns, l.objs.SkchCgroups} {
		all, err := bpfmap.Entries[uint64, uint32](m)
		var stale []uint64
		for key, ip := range all {
			if gone(bpfmap.Addr(ip)) {
				stale = append(stale, key)
			}
		}
		_, derr := bpfmap.Delete(m, stale)
		errs = append(errs, err, derr)
	}
	ips, ierr := bpfmap.Entries[uint32, uint8](l.objs.SkchIps)
	var staleIPs []uint32
	for ip := range ips {
		if gone(bpfmap.Addr(ip)) {
			staleIPs = append(staleIPs, ip)
		}
	}
	_, derr := bpfmap.Delete(l.objs.SkchIps, staleIPs)
	return errors.Join(append(errs, ierr, derr)...)
}

func (l *Layer) Endpoint(e cluster.Endpoint) (bool, string) {
	if err := l.eps.Err(e); err != nil {
		return false, err.Error()
	}
	if e.Cgroup == "" && !l.opts.Containers {
		return false, "no host sockets (no cgroupPath), and its own sockets are not joined (--channels-containers)"
	}
	return true, ""
}

func (l *Layer) Sync(_ context.Context, v *layer.View) error {
	l.eps.Sync(v.Local, l.attach, l.log)
	return l.forget(func(ip netip.Addr) bool {
		return !slices.ContainsFunc(v.Local, func(e cluster.Endpoint) bool { return e.IP.Addr() == ip && e.Limit.None() })
	})
}

// Settle ends the channelled connections a changed policy denies: the
// handshake of each passed the policy then in force, and its data passes
// no rule now.
func (l *Layer) Settle(_ context.Context, v *layer.View) error {
	if !v.PolicyChanged {
		return nil
	}
	return l.endDenied(v.Rules, v.Local)
}

// endDenied ends the channelled connections of containers' own sockets
// that rules deny, found in the socket hash itself: every connection's
// client side is there for as long as it lives (no side table that
// churn could evict).
func (l *Layer) endDenied(rules policy.Set, local []cluster.Endpoint) error {
	var kill []uint64
	where := map[netip.Addr]bool{}
	var k skchSkchKey
	var cookie uint64
	it := l.objs.SkchSocks.Iterate()
	for it.Next(&k, &cookie) {
		if k.Host != 0 || k.Client == 0 {
			continue
		}
		f := policy.Flow{Src: bpfmap.Addr(k.Sip), Dst: bpfmap.Addr(k.Dip), Proto: policy.TCP, Port: uint16(k.Dport)}
		if rules.Allowed(f) {
			continue
		}
		kill = append(kill, cookie)
		var peer uint64
		if err := l.objs.SkchSocks.Lookup(skchSkchKey{Sip: k.Dip, Dip: k.Sip, Sport: k.Dport, Dport: k.Sport}, &peer); err == nil {
			kill = append(kill, peer)
		}
		where[f.Src], where[f.Dst] = true, true
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read the channel map: %w", err)
	}
	var errs []error
	// In batches of what skch_kill holds, run in each namespace involved.
	for batch := int(l.objs.SkchKill.MaxEntries()); len(kill) > 0; kill = kill[min(batch, len(kill)):] {
		part := kill[:min(batch, len(kill))]
		for _, c := range part {
			if err := l.objs.SkchKill.Put(c, uint8(1)); err != nil {
				return fmt.Errorf("mark channelled sockets to end: %w", err)
			}
		}
		for _, e := range local {
			if where[e.IP.Addr()] {
				errs = append(errs, overlay.InNetns(e, func() error { _, err := bpfmap.Iterate(l.objs.SkchDestroy); return err }))
			}
		}
		_, derr := bpfmap.Delete(l.objs.SkchKill, part)
		errs = append(errs, derr)
	}
	return errors.Join(errs...)
}

// Counters names the programs' counters: enum skch_counter (channels.h),
// in its order, as the programs' BTF has it.
var Counters = sync.OnceValue(func() []string { return bpfmap.MustCounterNames(loadSkch, "skch_stats", "SKCH_") })

// Status is the channels layer of one host (api.Layer.Details).
type Status struct {
	// Counters are the programs' (Counters), by name: api.Layer.Counters.
	Counters map[string]uint64 `json:"-"`
	// Sockets are those in the channel map now (two a channelled
	// connection).
	Sockets int `json:"sockets"`
}

// StatusOf reads the channels layer's status from a host's status: nil
// when the layer does not run there.
func StatusOf(st api.Status) (*Status, error) {
	s, l, err := layer.DetailsOf[Status](st, "channels")
	if s != nil {
		s.Counters = l.Counters
	}
	return s, err
}

func (l *Layer) Status([]cluster.Endpoint) layer.Report {
	st := &Status{}
	st.Counters, _ = bpfmap.NamedCounters(l.objs.SkchStats, Counters())
	var k skchSkchKey
	var v uint64
	for it := l.objs.SkchSocks.Iterate(); it.Next(&k, &v); {
		st.Sockets++
	}
	return st.report()
}

func (s *Status) report() layer.Report {
	m := layer.Metrics{Layer: "channels"}
	m.Counters("events_total", "Events of the channels layer's programs (docs/channels.md, Status).", "event", s.Counters)
	m.Gauge("sockets", "Sockets in the channel map now (two a channelled connection).", float64(s.Sockets))
	var rows [][]string
	for _, name := range Counters() {
		rows = append(rows, []string{name, fmt.Sprint(s.Counters[name])})
	}
	return layer.Report{Counters: s.Counters, Details: s, Metrics: m.List(), View: []api.Section{
		{Title: fmt.Sprintf("channels: %d sockets channelled now", s.Sockets), Header: []string{"COUNTER", "COUNT"}, Rows: rows}}}
}

func (l *Layer) Close() error { return l.objs.Close() }
