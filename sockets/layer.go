package sockets

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/sockets/broker"
	"github.com/skiffnet/skiff/sockets/broker/seccomp"
)

// The sockets layer needs the cluster's listeners: its routes lead to them.
func init() {
	layer.Register(layer.Registration{Name: "sockets", Needs: layer.Needs{Listeners: true},
		Probe:    probe,
		New:      newAgentLayer,
		Teardown: teardownLayer,
		Flags:    flags,
	})
}

// flags: --sockets-secure, --broker, --seccomp-socket,
// --sockets-listener-quota; the cgroup root is skiffd's --cgroup-root.
func flags(fs *flag.FlagSet) layer.FlagOptions {
	var o Options
	fs.BoolVar(&o.Secure, "sockets-secure", true, "sockets layer: host sockets may only reach overlay listeners and may not change priority, TOS, mark or device")
	fs.StringVar(&o.Broker, "broker", "", "sockets layer: the skiff-broker binary (default: next to skiffd)")
	fs.StringVar(&o.SeccompSocket, "seccomp-socket", seccomp.DefaultListener, "sockets layer: where container runtimes hand over the seccomp listeners of skiff's profile (skiff seccomp-profile); \"\": none")
	fs.IntVar(&o.ListenerQuota, "sockets-listener-quota", DefaultListenerQuota, "sockets layer: ports one container's host sockets may hold, bound or listening; past it its listeners are its own sockets, reached through the overlay")
	return func(s layer.Settings) (any, error) {
		o.CgroupRoot = s.CgroupRoot
		return o, nil
	}
}

// Options are the sockets layer's settings (skiffd's --sockets-secure,
// --broker, --cgroup-root, --seccomp-socket, --sockets-listener-quota).
type Options struct {
	Secure     bool   // refuse what the fast path does not carry
	Broker     string // the skiff-broker binary (default: next to the running binary)
	CgroupRoot string // cgroup v2 mount (default: found or mounted)
	// SeccompSocket is where container runtimes hand over the seccomp
	// listeners of skiff's profile (its listenerPath); "" takes none.
	SeccompSocket string
	// ListenerQuota is the ports one container's host sockets may hold
	// (0: DefaultListenerQuota).
	ListenerQuota int
}

// Layer is the sockets layer as the agent drives it (package layer).
type Layer struct {
	opts      Options
	l         *dataPlane
	stateDir  string
	eps       layer.Attached // local containers given the layer
	enforced  bool           // the policy was enforced since start
	seccomp   *seccomp.Receiver
	publisher *publisher
	cgroups   layer.CgroupRecorder
	ctx       context.Context // Start's, for what the seccomp receiver does
}

// takeNotify gives a container process's seccomp listener to its
// container's broker; a process of no container with host sockets has its
// calls continued untouched (the overlay) by the host's keeper. A process
// of a pod whose runtime passed no cgroupPath gets the pod's cgroup
// recorded first (adopt).
func (a *Layer) takeNotify(h seccomp.Handoff) {
	id, err := a.l.brokers.GiveNotify(h.State.Pid, h.FD)
	if err != nil {
		if aerr := a.adopt(h); aerr == nil {
			id, err = a.l.brokers.GiveNotify(h.State.Pid, h.FD)
		} else if !errors.Is(aerr, errNoCgroups) {
			err = fmt.Errorf("%w; its cgroup not recorded: %w", err, aerr)
		}
	}
	if err != nil {
		a.l.log.Info("seccomp listener passed to the keeper: calls continue untouched (the overlay)", "runtime-id", h.State.State.ID, "pid", h.State.Pid, "why", err)
		a.l.brokers.GiveKeeper(h.FD)
		return
	}
	a.l.log.Info("seccomp listener passed to the broker", "container", id, "runtime-id", h.State.State.ID, "pid", h.State.Pid)
}

// The annotations a CRI runtime (containerd's CRI plugin) gives each
// container of a pod, in the OCI state a seccomp hand-off carries.
const (
	criContainerType = "io.kubernetes.cri.container-type" // "sandbox" or "container"
	criSandboxID     = "io.kubernetes.cri.sandbox-id"
)

// errNoCgroups: the agent records no cgroups (no CgroupRecorder).
var errNoCgroups = errors.New("the agent records no cgroups")

// adopt records the cgroup of a container whose runtime passed no
// cgroupPath to CNI, from the runtime's hand-off (on a socket only root
// reaches). A CRI pod's (containerd 1.6): the hand-off names the pod's
// sandbox, which is the endpoint's container ID, and the pod's cgroup is
// the parent of the process's container cgroup (every container of the
// pod, the sandbox's too, is below it). Any other runtime's (podman,
// ctr): the endpoint's container ID is the hand-off's, and the cgroup the
// process's own. Either way the process must be in that endpoint's
// network namespace, and the cgroup must be no other container's nor
// hold skiffd (the agent checks, as at ADD). The agent records it, and
// the layers attach the endpoint as if the runtime had passed it.
func (a *Layer) adopt(h seccomp.Handoff) error {
	if a.cgroups == nil {
		return errNoCgroups
	}
	pid := strconv.Itoa(h.State.Pid)
	var ns unix.Stat_t
	if err := unix.Stat("/proc/"+pid+"/ns/net", &ns); err != nil {
		return err
	}
	own, err := cgroup.Of(pid)
	if err != nil {
		return err
	}
	id, cg := podSandbox(h.State), filepath.Dir(own)
	if id == "" {
		id, cg = h.State.State.ID, own
	}
	if cg == "/" || cg == "." {
		return fmt.Errorf("process %s's cgroup %s is no container's", pid, own)
	}
	_, err = a.cgroups.RecordCgroup(a.ctx, id, ns.Dev, ns.Ino, cg)
	return err
}

// podSandbox is the pod sandbox a CRI runtime's hand-off names (its ID
// is the one CNI had), or "" for any other runtime's.
func podSandbox(st seccomp.State) string {
	switch ann := st.State.Annotations; ann[criContainerType] {
	case "container":
		return ann[criSandboxID]
	case "sandbox":
		return st.State.ID
	}
	return ""
}

// newAgentLayer takes Options (nil: secure, the broker next to the binary).
func newAgentLayer(options any) (layer.Layer, error) {
	o, err := parseOptions(options)
	if err != nil {
		return nil, err
	}
	return &Layer{opts: o}, nil
}

// parseOptions checks the layer's options and fills in the defaults.
func parseOptions(options any) (Options, error) {
	o := Options{Secure: true}
	switch v := options.(type) {
	case nil:
	case Options:
		o = v
	default:
		return o, fmt.Errorf("sockets layer options are a sockets.Options, not %T", options)
	}
	if o.ListenerQuota < 0 {
		return o, fmt.Errorf("a listener quota of %d: give 1 or more (0: %d)", o.ListenerQuota, DefaultListenerQuota)
	}
	if o.Broker == "" {
		exe, err := os.Executable()
		if err != nil {
			return o, fmt.Errorf("find skiff-broker: %w", err)
		}
		o.Broker = filepath.Join(filepath.Dir(exe), "skiff-broker")
	}
	if _, err := os.Stat(o.Broker); err != nil {
		return o, fmt.Errorf("the socket broker is missing: %w (give --broker)", err)
	}
	return o, nil
}

// probe checks what the layer needs: its program types and the helpers
// and maps no older kernel has (sk_lookup with bpf_sk_assign, header
// options from sockops, bpf_set_retval), bpf_sock_destroy to end what the
// policy denies, cgroup v2 for the hooks (mounted if it is not), and the
// broker.
func probe(options any) error {
	o, err := parseOptions(options)
	if err != nil {
		return err
	}
	return layer.First(
		layer.Programs(ebpf.CGroupSock),
		layer.Programs(ebpf.CGroupSockAddr),
		layer.Programs(ebpf.CGroupSockopt, asm.FnSetRetval),
		layer.Programs(ebpf.SockOps, asm.FnReserveHdrOpt, asm.FnStoreHdrOpt),
		layer.Programs(ebpf.SkLookup, asm.FnSkAssign),
		layer.Programs(ebpf.SchedCLS, asm.FnTcpCheckSyncookie),
		layer.Maps(ebpf.SockHash, ebpf.SkStorage, ebpf.RingBuf, ebpf.ArrayOfMaps),
		layer.KernelHas("bpf_sock_destroy, to end connections the policy denies", "bpf_sock_destroy"),
		func() error { return probeCgroup(o.CgroupRoot) },
	)
}

// probeCgroup checks for a cgroup v2 mount: root, or the system's (mounted
// at cgroup.DefaultRoot when it has none).
func probeCgroup(root string) error {
	var err error
	if root == "" {
		_, err = cgroup.Root()
	} else {
		err = cgroup.Mount(root)
	}
	if err != nil {
		return fmt.Errorf("cgroup v2 is not mounted and cannot be mounted: %w", err)
	}
	return nil
}

// Start loads the layer (reusing pinned state), attaches its host-wide
// programs and publishes this host's replaced listeners whenever they
// change.
func (a *Layer) Start(ctx context.Context, env layer.Env) error {
	root := a.opts.CgroupRoot
	if root == "" {
		var err error
		if root, err = cgroup.Root(); err != nil {
			return err
		}
	} else if err := cgroup.Mount(root); err != nil {
		return err
	}
	l, err := load(Config{Cluster: env.Cluster, Host: env.Host, Underlay: env.Underlay,
		PinDir: env.PinDir, Secure: a.opts.Secure, CgroupRoot: root, Broker: a.opts.Broker,
		StateDir: env.StateDir, ListenerQuota: a.opts.ListenerQuota}, env.Log)
	if err != nil {
		return err
	}
	if err := l.Setup(); err != nil {
		l.Close()
		return fmt.Errorf("set up sockets layer: %w", err)
	}
	changed, err := l.WatchListeners(ctx)
	if err != nil {
		l.Close()
		return err
	}
	a.l, a.stateDir, a.cgroups, a.ctx = l, env.StateDir, env.Cgroups, ctx
	if a.opts.SeccompSocket != "" {
		r, err := seccomp.Listen(a.opts.SeccompSocket, env.Log)
		if err != nil {
			l.Close()
			return err
		}
		a.seccomp = r
		go r.Serve(ctx, a.takeNotify)
		env.Log.Info("seccomp agent listening", "socket", a.opts.SeccompSocket)
	}
	a.publisher = newPublisher(env.Host.Name, l.LocalListeners, env.Listeners, env.Log)
	go a.publisher.run(ctx, changed)
	env.Log.Info("sockets layer attached", "pins", env.PinDir, "cgroups", root, "secure", a.opts.Secure)
	return nil
}

// teardownLayer removes a sockets layer an earlier run left behind, and
// the seccomp agent's socket.
func teardownLayer(env layer.Env, options any) (bool, error) {
	removed := false
	if o, ok := options.(Options); ok && o.SeccompSocket != "" {
		removed = os.Remove(o.SeccompSocket) == nil
	}
	if !pinned(env.PinDir) {
		return removed, nil
	}
	if err := teardown(env.PinDir, env.StateDir); err != nil {
		return true, fmt.Errorf("remove the sockets layer: %w", err)
	}
	return true, nil
}

// AddEndpoint gives a container host sockets; without them it uses the
// overlay (a failure is the container's, tried again at every Sync).
func (a *Layer) AddEndpoint(_ context.Context, e cluster.Endpoint) error {
	return a.eps.Add(e, a.l.AddEndpoint)
}

func (a *Layer) RemoveEndpoint(_ context.Context, e cluster.Endpoint) error {
	a.eps.Remove(e)
	return a.l.RemoveEndpoint(e)
}

// Endpoint says whether a local container's TCP can take host sockets,
// and why not.
func (a *Layer) Endpoint(e cluster.Endpoint) (bool, string) {
	if !replaced(e) {
		return false, "no cgroupPath from the runtime"
	}
	if err := a.eps.Err(e); err != nil {
		return false, err.Error()
	}
	if bs := broker.ReadStats(a.stateDir, e.ContainerID); bs.Privileged != 0 {
		return false, fmt.Sprintf("refused: pid %d may hold NET_ADMIN or SYS_ADMIN", bs.Privileged)
	}
	if !a.l.BrokerRunning(e.ContainerID) {
		return false, "its socket broker is down (restarted)"
	}
	return true, ""
}

// Sync applies a cluster change: routes to the published listeners and the
// policy new fast-path connections are judged by, host subnets for
// anti-spoofing, programs and brokers for new containers; on a policy
// change it ends the replaced connections the new policy denies, and the
// overlay's policy judges the overlay packets the layer delivers to the
// host stack while it has rules. It runs before the overlay applies the
// rules, so a first rule is judged on INPUT as soon as on FORWARD.
func (a *Layer) Sync(_ context.Context, v *layer.View) error {
	errs := []error{a.l.Sync(v.Hosts, v.Listeners, v.Rules), a.l.PruneEndpoints(v.Local)}
	a.eps.Sync(v.Local, a.l.AddEndpoint, a.l.log)
	// Walking every TCP socket of the host is for policy changes (and the
	// first sync, which may follow one made while the agent was down).
	if v.PolicyChanged || !a.enforced {
		errs = append(errs, a.l.JudgeInput(len(v.Rules) > 0))
		n, err := a.l.Enforce(v.Rules)
		if n > 0 {
			a.l.log.Info("ended replaced connections the policy denies", "connections", n)
		}
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	a.enforced = true
	return nil
}

func (a *Layer) Settle(context.Context, *layer.View) error { return nil }

// Listeners applies a change of the published listeners: only the routes
// depend on them.
func (a *Layer) Listeners(_ context.Context, v *layer.View) error {
	return a.l.Sync(v.Hosts, v.Listeners, v.Rules)
}

func (a *Layer) Close() error {
	if a.seccomp != nil {
		a.seccomp.Close()
	}
	return a.l.Close()
}

var _ layer.Listening = (*Layer)(nil)
