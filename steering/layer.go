// Package steering is skiff's steering layer: the stages of one overlay
// flow's receive path (underlay and decapsulation, forwarding and bridge,
// the container's stack) run on different CPUs, chosen per stage by
// hashing the flow with the stage's device and avoiding loaded CPUs
// (Falcon, paper 003 ch. 3), on a stock kernel: per-device RPS masks and
// tc programs that write the hash RPS follows (steering.c).
// docs/steering.md.
package steering

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/tc"
)

// Manual is why auto leaves the layer off.
const Manual = "runs only when named (--layers ...,steering or --mode steering): each stage moved to another CPU costs a hand-over, which pays only for heavy flows on hosts with cores to spare (docs/steering.md)"

func init() {
	layer.Register(layer.Registration{Name: "steering", Manual: Manual, Probe: probe, New: newLayer, Teardown: teardown, Flags: flags})
}

// flags: --steering-cpus, --steering-threshold, --steering-udp-batch,
// --steering-heavy.
func flags(fs *flag.FlagSet) layer.FlagOptions {
	var o Options
	fs.Func("steering-cpus", "steering layer: the CPUs the stages of overlay flows are spread over, comma-separated (default: every CPU)", func(v string) error {
		for _, f := range layer.SplitList(v) {
			c, err := strconv.Atoi(f)
			if err != nil {
				return fmt.Errorf("CPU %q: not a number", f)
			}
			o.CPUs = append(o.CPUs, c)
		}
		return nil
	})
	fs.IntVar(&o.Threshold, "steering-threshold", DefaultThreshold, "steering layer: a CPU's load (percent) at which a stage takes its second choice")
	fs.IntVar(&o.UDPBatch, "steering-udp-batch", 0, "steering layer: split heavy UDP flows, moving their next stage to the next CPU every this many packets (mFlow; 0: no splitting)")
	fs.IntVar(&o.HeavyBytes, "steering-heavy", DefaultHeavyBytes, "steering layer: bytes a flow carries in a millisecond before its stages spread (-1: every flow)")
	return func(layer.Settings) (any, error) { return o, nil }
}

// probe checks for tc programs that set the hash, per-CPU maps and RPS
// (CONFIG_RPS: receive queues have rps_cpus).
func probe(any) error {
	return layer.First(
		layer.Programs(ebpf.SchedCLS, asm.FnSetHash),
		layer.Maps(ebpf.PerCPUArray),
		func() error {
			if _, err := os.Stat("/sys/class/net/lo/queues/rx-0/rps_cpus"); err != nil {
				return fmt.Errorf("no RPS in this kernel (CONFIG_RPS): %w", err)
			}
			return nil
		},
	)
}

// Options are the layer's (skiffd --steering-cpus, --steering-threshold).
type Options struct {
	// CPUs take part in the stages (ascending); nil: every online CPU.
	CPUs []int
	// Threshold is the load (percent) at which a stage's first CPU gives
	// way to its second (Falcon's two-choice rule); 0: DefaultThreshold.
	Threshold int
	// Interval is how often the CPUs' loads are sampled; 0: 10 ms.
	Interval time.Duration
	// HeavyBytes is how many bytes a flow carries in a millisecond at a
	// stage's device before its next stage moves to another CPU; lighter
	// flows (request/response) stay on the CPU they are on. 0:
	// DefaultHeavyBytes; -1: every flow is steered.
	HeavyBytes int
	// UDPBatch splits a heavy UDP flow: its next stage moves to the next
	// CPU every UDPBatch packets (mFlow's micro-flows; the receiver may
	// see datagrams out of order). 0: a flow's stage stays on one CPU.
	UDPBatch int
}

// DefaultHeavyBytes: 32 KiB a millisecond, 262 Mbit/s.
const DefaultHeavyBytes = 32 << 10

// DefaultThreshold is the two-choice rule's load threshold by default.
const DefaultThreshold = 80

// staleAfter: loads older than this are not believed (the agent stopped).
const staleAfter = 200 * time.Millisecond

// Layer is the steering layer as the agent drives it.
type Layer struct {
	opts Options
	objs stxObjects
	env  layer.Env
	log  *slog.Logger
	eps  layer.Attached
	// masksMu makes each read, change and save of the state file's masks
	// one step: the agent adds and removes containers at once.
	masksMu sync.Mutex
	loads   atomic.Pointer[stxStxLoad]
	// The load sampler: stopped and waited for by Close.
	stop     context.CancelFunc
	sampling sync.WaitGroup
}

func newLayer(options any) (layer.Layer, error) {
	var o Options
	switch v := options.(type) {
	case nil:
	case Options:
		o = v
	default:
		return nil, fmt.Errorf("steering layer options are steering.Options, not %T", options)
	}
	if o.CPUs == nil {
		o.CPUs = onlineCPUs()
	}
	o.CPUs = slices.Compact(slices.Sorted(slices.Values(o.CPUs)))
	if len(o.CPUs) == 0 || o.CPUs[0] < 0 || o.CPUs[len(o.CPUs)-1] >= MaxCPUs {
		return nil, fmt.Errorf("steering CPUs %v: want CPUs 0 to %d", o.CPUs, MaxCPUs-1)
	}
	if o.Threshold == 0 {
		o.Threshold = DefaultThreshold
	}
	if o.Threshold < 1 || o.Threshold > 100 {
		return nil, fmt.Errorf("steering threshold %d: want 1 to 100 (percent)", o.Threshold)
	}
	if o.Interval == 0 {
		o.Interval = 10 * time.Millisecond
	}
	switch {
	case o.HeavyBytes == 0:
		o.HeavyBytes = DefaultHeavyBytes
	case o.HeavyBytes == -1:
	case o.HeavyBytes < 0 || o.HeavyBytes > 1<<30:
		return nil, fmt.Errorf("steering heavy flows %d bytes a millisecond: want 0 to 2^30 (-1: every flow)", o.HeavyBytes)
	}
	if o.UDPBatch < 0 {
		return nil, fmt.Errorf("steering UDP batch %d: want 0 (no splitting) or more packets", o.UDPBatch)
	}
	return &Layer{opts: o}, nil
}

// onlineCPUs are the CPUs this process may run on (the first MaxCPUs).
func onlineCPUs() []int {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil
	}
	var cpus []int
	for c := 0; c < MaxCPUs; c++ {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus
}

// filterName tags the layer's tc filters (tc.PrioSteering).
const filterName = "skiff-steering"

// oldLinks held the TCX links of an earlier skiff (the layer's programs
// are tc filters now): unpinning them detaches those programs.
func oldLinks(pinDir string) string { return filepath.Join(pinDir, "stx_links") }

// Start loads the programs, writes the configuration, attaches the
// underlay's and skiff.vxlan's programs, gives skiff.vxlan the RPS mask of
// the CPUs taking part, and samples the CPUs' loads until ctx ends.
func (l *Layer) Start(ctx context.Context, env layer.Env) error {
	l.env, l.log = env, env.Log
	spec, err := loadStx()
	if err != nil {
		return fmt.Errorf("read steering programs: %w", err)
	}
	for name, v := range map[string]any{
		"cfg_vxlan_port":  bpfmap.Port(uint16(env.Cluster.VXLANPort)),
		"cfg_vni":         uint32(env.Cluster.VNI),
		"cfg_underlay_ip": bpfmap.IPv4(env.Host.UnderlayIP),
	} {
		if err := spec.Variables[name].Set(v); err != nil {
			return fmt.Errorf("configure steering programs: %s: %w", name, err)
		}
	}
	if err := bpffs.Load(spec, &l.objs, env.PinDir, env.Log); err != nil {
		return fmt.Errorf("load steering programs: %w", err)
	}
	// The seed an earlier run chose stays (a new one would move every
	// flow's stages at once).
	var old stxStxCfg
	if err := l.objs.StxConfig.Lookup(uint32(0), &old); err != nil {
		return fmt.Errorf("steering configuration: %w", err)
	}
	seed := old.Seed
	for seed == 0 {
		var b [4]byte
		if _, err := rand.Read(b[:]); err != nil {
			return fmt.Errorf("steering seed: %w", err)
		}
		seed = binary.NativeEndian.Uint32(b[:])
	}
	cfg := stxStxCfg{N: uint32(len(l.opts.CPUs)), Threshold: uint32(l.opts.Threshold), StaleNs: uint64(staleAfter),
		HeavyBytes: uint32(max(l.opts.HeavyBytes, 0)), WindowNs: uint32(time.Millisecond), UdpBatch: uint32(l.opts.UDPBatch), Seed: seed}
	for i, c := range l.opts.CPUs {
		cfg.Cpus[i] = uint32(c)
	}
	if err := l.objs.StxConfig.Put(uint32(0), cfg); err != nil {
		return fmt.Errorf("configure steering: %w", err)
	}
	h := &netlink.Handle{}
	for dev, prog := range map[string]*ebpf.Program{env.Underlay: l.objs.StxUnderlay, overlay.VXLANName: l.objs.StxVxlan} {
		if err := attachFilter(h, dev, tc.Ingress, prog); err != nil {
			return err
		}
	}
	if err := os.RemoveAll(oldLinks(env.PinDir)); err != nil {
		return fmt.Errorf("steering: links of an earlier skiff: %w", err)
	}
	w := readWritten(env.StateDir, env.Log)
	if err := w.steerDevice(env.StateDir, "", overlay.VXLANName, FormatMask(l.opts.CPUs)); err != nil {
		return err
	}
	// The kernel's RPS map is the mask's CPUs that are possible: the
	// programs must pick among exactly those.
	var got string
	if err := inSysfs(nil, func(sys string) (err error) { got, err = rpsOf(sys, overlay.VXLANName); return err }); err != nil {
		return err
	}
	if !sameMask(got, FormatMask(l.opts.CPUs)) {
		return fmt.Errorf("steering CPUs %v: the kernel took %s for %s (offline or impossible CPUs?)", l.opts.CPUs, got, overlay.VXLANName)
	}
	ctx, l.stop = context.WithCancel(ctx)
	l.sampling.Add(1)
	go func() {
		defer l.sampling.Done()
		l.sample(ctx, l.opts.Interval)
	}()
	return nil
}

// attachFilter keeps prog on dev's hook (a clsact filter, in h's
// namespace): a restart replaces it in place.
func attachFilter(h *netlink.Handle, dev string, hook uint32, prog *ebpf.Program) error {
	d, err := h.LinkByName(dev)
	if err != nil {
		return fmt.Errorf("steering: device %s: %w", dev, err)
	}
	return tc.Attach(h, d, hook, tc.PrioSteering, filterName, prog)
}

// attach steers a local container's stage: the host veth's egress writes
// the hash its eth0's RPS follows; its eth0 counts the stage and gets the
// mask of the CPUs taking part.
func (l *Layer) attach(e cluster.Endpoint) error {
	if err := attachFilter(&netlink.Handle{}, e.Veth, tc.Egress, l.objs.StxToContainer); err != nil {
		return err
	}
	ns, err := overlay.OpenNetns(e)
	if err != nil {
		return err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("steering: netlink in %s: %w", e.Netns, err)
	}
	err = attachFilter(h, e.IfName, tc.Ingress, l.objs.StxContainer)
	h.Close()
	if err != nil {
		return err
	}
	mask := FormatMask(l.opts.CPUs)
	if err := inSysfs(&ns, func(sys string) error { return setRPS(sys, e.IfName, mask) }); err != nil {
		return err
	}
	return l.masks(func(m map[string]string) bool { m[maskKey(e.Netns, e.IfName)] = mask; return true })
}

// masks applies change to the masks the state file records, and saves
// them when it says they changed.
func (l *Layer) masks(change func(map[string]string) bool) error {
	l.masksMu.Lock()
	defer l.masksMu.Unlock()
	w := readWritten(l.env.StateDir, l.log)
	if !change(w.Masks) {
		return nil
	}
	return w.save(l.env.StateDir)
}

func (l *Layer) AddEndpoint(_ context.Context, e cluster.Endpoint) error {
	return l.eps.Add(e, l.attach)
}

// RemoveEndpoint forgets a container's mask (its devices, and the
// programs on them, go with it).
func (l *Layer) RemoveEndpoint(_ context.Context, e cluster.Endpoint) error {
	l.eps.Remove(e)
	return l.masks(func(m map[string]string) bool { delete(m, maskKey(e.Netns, e.IfName)); return true })
}

// prune forgets the masks of containers that are no longer local (removed
// while the agent was down, or collected).
func (l *Layer) prune(local []cluster.Endpoint) error {
	masks := map[string]bool{}
	for _, e := range local {
		masks[maskKey(e.Netns, e.IfName)] = true
	}
	return l.masks(func(m map[string]string) bool {
		changed := false
		for key := range m {
			if ns, _, _ := strings.Cut(key, "|"); ns != "" && !masks[key] {
				delete(m, key)
				changed = true
			}
		}
		return changed
	})
}

func (l *Layer) Endpoint(e cluster.Endpoint) (bool, string) {
	if err := l.eps.Err(e); err != nil {
		return false, err.Error()
	}
	return true, ""
}

func (l *Layer) Sync(_ context.Context, v *layer.View) error {
	l.eps.Sync(v.Local, l.attach, l.log)
	return l.prune(v.Local)
}

func (l *Layer) Settle(context.Context, *layer.View) error { return nil }

// Stages names the stages, in the order of enum stx_stage, with the
// device each runs on.
var Stages = []struct{ Name, Device string }{
	{"underlay", "underlay (IP, UDP, VXLAN decapsulation)"},
	{"vxlan", overlay.VXLANName + " (forwarding, bridge, host veth)"},
	{"container", "container eth0 (IP, TCP/UDP, socket)"},
}

// Decisions names the programs' counters: enum stx_reason (steering.h), in
// its order, as the programs' BTF has it.
var Decisions = sync.OnceValue(func() []string { return bpfmap.MustCounterNames(loadStx, "stx_stats", "STX_") })

// Status is the steering layer of one host (api.Layer.Details): the CPUs
// the stages of overlay flows are spread over, the two-choice threshold,
// each stage's packets per CPU (where it ran), the decisions by reason,
// and each CPU's load as last sampled (percent).
type Status struct {
	CPUs      []int             `json:"cpus"`
	Threshold int               `json:"threshold"`
	Stages    []Stage           `json:"stages"`
	Decisions map[string]uint64 `json:"-"` // api.Layer.Counters
	Load      map[int]uint32    `json:"load,omitempty"`
}

// Stage is one stage of the overlay's receive path: its device and the
// packets it processed on each CPU.
type Stage struct {
	Name    string   `json:"name"`
	Device  string   `json:"device"`
	Packets []uint64 `json:"packets"` // by CPU
}

// StatusOf reads the steering layer's status from a host's status: nil
// when the layer does not run there.
func StatusOf(st api.Status) (*Status, error) {
	s, l, err := layer.DetailsOf[Status](st, "steering")
	if s != nil {
		s.Decisions = l.Counters
	}
	return s, err
}

func (l *Layer) Status([]cluster.Endpoint) layer.Report {
	st := &Status{CPUs: l.opts.CPUs, Threshold: l.opts.Threshold, Decisions: map[string]uint64{}}
	if d, err := bpfmap.NamedCounters(l.objs.StxStats, Decisions()); err == nil {
		st.Decisions = d
	}
	for i, stage := range Stages {
		var per []uint64
		if err := l.objs.StxStages.Lookup(uint32(i), &per); err != nil {
			break
		}
		st.Stages = append(st.Stages, Stage{Name: stage.Name, Device: stage.Device, Packets: per})
	}
	if v := l.loads.Load(); v != nil {
		st.Load = map[int]uint32{}
		for _, c := range l.opts.CPUs {
			st.Load[c] = v.Pct[c]
		}
	}
	return st.report()
}

func (s *Status) report() layer.Report {
	m := layer.Metrics{Layer: "steering"}
	type stageCPU struct {
		stage string
		cpu   int
		n     uint64
	}
	var per []stageCPU
	for _, st := range s.Stages {
		for cpu, n := range st.Packets {
			per = append(per, stageCPU{st.Name, cpu, n})
		}
	}
	m.Add("stage_packets_total", "Packets of overlay flows each stage of the receive path processed, by CPU (docs/steering.md).",
		prometheus.CounterValue, []string{"stage", "cpu"}, len(per), func(i int) float64 { return float64(per[i].n) },
		func(i int) []string { return []string{per[i].stage, strconv.Itoa(per[i].cpu)} })
	m.Counters("decisions_total", "The steering programs' decisions and what they left alone, by reason.", "decision", s.Decisions)
	cpus := slices.Sorted(maps.Keys(s.Load))
	m.Add("cpu_load", "Each steering CPU's load as last sampled (percent, smoothed).", prometheus.GaugeValue, []string{"cpu"}, len(cpus),
		func(i int) float64 { return float64(s.Load[cpus[i]]) }, func(i int) []string { return []string{strconv.Itoa(cpus[i])} })

	var loads []string
	for _, c := range s.CPUs {
		loads = append(loads, fmt.Sprintf("cpu%d %d%%", c, s.Load[c]))
	}
	header := []string{"STAGE", "DEVICE"}
	ncpu := 0
	for _, st := range s.Stages {
		ncpu = max(ncpu, len(st.Packets))
	}
	for c := range ncpu {
		header = append(header, fmt.Sprintf("CPU%d", c))
	}
	var rows [][]string
	for _, st := range s.Stages {
		r := []string{st.Name, st.Device}
		for _, n := range st.Packets {
			r = append(r, fmt.Sprint(n))
		}
		rows = append(rows, r)
	}
	var decisions [][]string
	for _, name := range Decisions() {
		decisions = append(decisions, []string{name, fmt.Sprint(s.Decisions[name])})
	}
	return layer.Report{Counters: s.Decisions, Details: s, Metrics: m.List(), View: []api.Section{
		{Title: fmt.Sprintf("steering: CPUs %v, second choice above %d%% load; load now: %s", s.CPUs, s.Threshold, strings.Join(loads, ", ")),
			Header: header, Rows: rows},
		{Header: []string{"DECISION", "PACKETS"}, Rows: decisions},
	}}
}

// Close stops the load sampler, then releases the maps and programs.
func (l *Layer) Close() error {
	if l.stop != nil {
		l.stop()
		l.sampling.Wait()
	}
	return l.objs.Close()
}

// teardown removes an earlier run's programs (its filters on the host's
// devices and on the containers' interfaces it steered) and maps, and puts
// the kernel's default RPS back on the devices it steered.
func teardown(env layer.Env, _ any) (bool, error) {
	w := readWritten(env.StateDir, env.Log)
	pins, _ := filepath.Glob(filepath.Join(env.PinDir, "stx_*"))
	if len(pins) == 0 && len(w.Masks) == 0 {
		return false, nil
	}
	return true, errors.Join(w.detach(), bpffs.Unpin(env.PinDir, "stx_"), w.restore(env.StateDir, env.Log))
}
