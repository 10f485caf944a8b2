// Package lab builds an emulated skiff cluster on one Linux machine. Each
// host is a network namespace running its own skiffd; the hosts are joined
// by an underlay switch (a bridge in a namespace of its own, which also runs
// the cluster's etcd); containers are network namespaces attached through
// skiff-cni via libcni, the path containerd takes. Everything the lab makes
// is named skiff-<lab>-..., and the machine's own network is never touched.
package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/agent"
	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/sockets"
	"github.com/skiffnet/skiff/sockets/broker/seccomp"
	"github.com/skiffnet/skiff/store"
)

// RunDir holds every lab's state, sockets and logs.
const RunDir = "/run/skiff/lab"

// DefaultName is the lab's name when none is given.
const DefaultName = "lab"

var (
	underlayNet = netip.MustParsePrefix("10.99.0.0/24")
	switchAddr  = netip.MustParseAddr("10.99.0.254")
	namePattern = regexp.MustCompile(`^[a-z][a-z0-9]{0,7}$`)
)

// Config describes a lab to bring up.
type Config struct {
	Name              string `json:"name"`
	Hosts             int    `json:"hosts"`
	ContainersPerHost int    `json:"containersPerHost"`
	Mode              string `json:"mode"`
	UnderlayMTU       int    `json:"underlayMTU"`
	ClusterCIDR       string `json:"clusterCIDR"`
	// BinDir holds skiff, skiffd and skiff-cni (default: next to the running
	// executable).
	BinDir string `json:"binDir"`
	// AgentArgs are extra skiffd flags for every host.
	AgentArgs []string `json:"agentArgs,omitempty"`
	// EtcdInsecure runs the store on plain HTTP without client
	// certificates (to compare); by default it takes TLS only.
	EtcdInsecure bool `json:"etcdInsecure,omitempty"`
	// EtcdMembers is how many etcd members the store has (1, 3, 5 or 7;
	// default 1). A store of 2k+1 members survives the loss of k.
	EtcdMembers int `json:"etcdMembers,omitempty"`
	// SlimRouters runs the papers' Slim and SlimFast routers on every host
	// (package slim), and gives containers' commands what libslim.so needs
	// to reach them (skiff bench's slim and slimfast modes).
	SlimRouters bool `json:"slimRouters,omitempty"`
	// Prepare runs once the switch and the store are up, before any host:
	// what the agents need at start (a Kubernetes control plane in the
	// switch's namespace, whose address the hosts reach).
	Prepare func(context.Context, *Lab) error `json:"-"`
}

// Runs reports whether the lab's agents run a layer (auto runs every one
// this machine can: the lab needs what each asks of it, such as the
// sockets layer's cgroups and shim).
func (c *Config) Runs(layer string) bool { return c.Mode == layer || c.Mode == "auto" }

// maxEtcdMembers: etcd's own advice (more make every write slower).
const maxEtcdMembers = 7

func (c *Config) defaults() error {
	if c.Name == "" {
		c.Name = DefaultName
	}
	if !namePattern.MatchString(c.Name) {
		return fmt.Errorf("lab name %q: use 1-8 lower-case letters and digits, starting with a letter", c.Name)
	}
	if c.Hosts == 0 {
		c.Hosts = 2
	}
	if c.Hosts < 1 || c.Hosts > 200 {
		return fmt.Errorf("%d hosts: choose 1-200", c.Hosts)
	}
	if c.ContainersPerHost < 0 || c.ContainersPerHost > 200 {
		return fmt.Errorf("%d containers per host: choose 0-200", c.ContainersPerHost)
	}
	if c.Mode == "" {
		c.Mode = "overlay"
	}
	if !slices.Contains(agent.Modes(), c.Mode) {
		return fmt.Errorf("mode %q: choose one of %s", c.Mode, strings.Join(agent.Modes(), ", "))
	}
	if c.EtcdMembers == 0 {
		c.EtcdMembers = 1
	}
	if c.EtcdMembers < 1 || c.EtcdMembers > maxEtcdMembers || c.EtcdMembers%2 == 0 {
		return fmt.Errorf("%d etcd members: choose 1, 3, 5 or 7 (the store works while a majority runs, so an even number survives no more losses than one fewer)", c.EtcdMembers)
	}
	if c.UnderlayMTU == 0 {
		c.UnderlayMTU = 1500
	}
	if c.UnderlayMTU < 1280 || c.UnderlayMTU > 9000 {
		return fmt.Errorf("underlay MTU %d: choose 1280-9000", c.UnderlayMTU)
	}
	if c.ClusterCIDR == "" {
		c.ClusterCIDR = "10.244.0.0/16"
	}
	// the agents would refuse these only after the lab is built
	if p, err := netip.ParsePrefix(c.ClusterCIDR); err != nil || !p.Addr().Is4() || p.Masked() != p || p.Bits() > 24 {
		return fmt.Errorf("cluster CIDR %q: want an IPv4 network of /24 or larger, such as 10.244.0.0/16", c.ClusterCIDR)
	} else if p.Overlaps(underlayNet) {
		return fmt.Errorf("cluster CIDR %s overlaps the lab's underlay %s", p, underlayNet)
	}
	if c.BinDir == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("find binaries: %w", err)
		}
		c.BinDir = filepath.Dir(exe)
	}
	bins := []string{"skiff", "skiffd", "skiff-cni"}
	if c.Runs("sockets") {
		bins = append(bins, "skiff-broker", "libskiff.so")
	}
	if c.SlimRouters {
		bins = append(bins, "libslim.so")
	}
	for _, b := range bins {
		if _, err := os.Stat(filepath.Join(c.BinDir, b)); err != nil {
			return fmt.Errorf("binary %s not found in %s (run make build): %w", b, c.BinDir, err)
		}
	}
	return nil
}

// Host is a lab host.
type Host struct {
	Name       string     `json:"name"`
	Netns      string     `json:"netns"`
	UnderlayIP netip.Addr `json:"underlayIP"`
	AgentPID   int        `json:"agentPID"`
	Socket     string     `json:"socket"`
}

// Container is a lab container.
type Container struct {
	Name  string     `json:"name"` // h1/c2
	Host  string     `json:"host"`
	ID    string     `json:"id"`
	Netns string     `json:"netns"`
	IP    netip.Addr `json:"ip"`
	// Cgroup is the container's cgroup v2 directory (sockets mode).
	Cgroup string `json:"cgroup,omitempty"`
}

// Member is a member of the lab's store, running in the switch namespace
// on an address of its own.
type Member struct {
	Name  string     `json:"name"` // e1
	Netns string     `json:"netns"`
	IP    netip.Addr `json:"ip"`
	PID   int        `json:"pid"`
}

// Lab is a running lab, as recorded in its state file.
type Lab struct {
	Config    Config   `json:"config"`
	Etcd      []Member `json:"etcd"`
	HostsMade int      `json:"hostsMade"` // hosts are never renumbered

	Hosts      []Host      `json:"hosts"`
	Containers []Container `json:"containers"`

	// addRetries counts the ADDs an agent asked to try again later (CNI
	// error 11) that were tried again.
	addRetries int
}

// Dir is the lab's run directory.
func Dir(name string) string { return filepath.Join(RunDir, name) }

func (l *Lab) dir() string         { return Dir(l.Config.Name) }
func (l *Lab) prefix() string      { return "skiff-" + l.Config.Name + "-" }
func (l *Lab) switchNetns() string { return l.prefix() + "sw" }

// SwitchNetns is the network namespace of the lab's switch: the store
// serves there, on the underlay's address SwitchAddr.
func (l *Lab) SwitchNetns() string { return l.switchNetns() }

// SwitchAddr is the switch's address on the underlay.
func SwitchAddr() netip.Addr { return switchAddr }

func (l *Lab) pkiDir() string { return filepath.Join(l.dir(), "pki") }

// members are the store's members: e1 at the switch's address, the
// others counting down from it, below the hosts' addresses counting up.
func (l *Lab) members() []Member {
	ms := make([]Member, l.Config.EtcdMembers)
	for i := range ms {
		ip := switchAddr.As4()
		ip[3] -= byte(i)
		ms[i] = Member{Name: fmt.Sprintf("e%d", i+1), Netns: l.switchNetns(), IP: netip.AddrFrom4(ip)}
	}
	return ms
}

func (l *Lab) clientURL(m Member) string { return l.etcdScheme() + m.IP.String() + ":2379" }
func (l *Lab) peerURL(m Member) string   { return l.etcdScheme() + m.IP.String() + ":2380" }

// etcdURL is what an agent's --etcd-endpoints says: every member's client URL.
func (l *Lab) etcdURL() string { return strings.Join(l.EtcdEndpoints(), ",") }

func (l *Lab) etcdScheme() string {
	if l.Config.EtcdInsecure {
		return "http://"
	}
	return "https://"
}

// EtcdEndpoints are the client URLs of the lab's store.
func (l *Lab) EtcdEndpoints() []string {
	var out []string
	for _, m := range l.Etcd {
		out = append(out, l.clientURL(m))
	}
	return out
}

// EtcdTLS gives the credentials of a store client with common name name (a
// host's name, or store.AdminName), issuing its certificate when needed.
func (l *Lab) EtcdTLS(name string) (store.TLS, error) {
	if l.Config.EtcdInsecure {
		return store.TLS{Insecure: true}, nil
	}
	p, err := store.LoadPKI(l.pkiDir())
	if err != nil {
		return store.TLS{}, fmt.Errorf("lab %s: %w", l.Config.Name, err)
	}
	t, _, err := p.EnsureClient(name)
	return t, err
}

// OpenStore connects to the lab's store from the network namespace of
// from (a host, a container, or "" for the underlay switch, where the store
// runs) as the client with common name name (a host's name, or
// store.AdminName).
func (l *Lab) OpenStore(from, name string) (*store.Store, error) {
	ns := l.switchNetns()
	if from != "" {
		var err error
		if ns, err = l.Netns(from); err != nil {
			return nil, err
		}
	}
	t, err := l.EtcdTLS(name)
	if err != nil {
		return nil, err
	}
	return store.OpenVia(l.EtcdEndpoints(), t, func(ctx context.Context, addr string) (c net.Conn, err error) {
		err = inNetns(ns, func() error {
			c, err = (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			return err
		})
		return c, err
	})
}

// Admin runs f with the lab's store as the administrator: policy changes,
// host removal, users and roles.
func (l *Lab) Admin(f func(*store.Store) error) error {
	s, err := l.OpenStore("", store.AdminName)
	if err != nil {
		return err
	}
	defer s.Close()
	return f(s)
}

// PutPolicy adds or replaces a policy rule, as the administrator.
func (l *Lab) PutPolicy(ctx context.Context, r policy.Rule) error {
	return l.Admin(func(s *store.Store) error { return s.PutPolicy(ctx, r) })
}

// DeletePolicy removes a policy rule, as the administrator.
func (l *Lab) DeletePolicy(ctx context.Context, id string) error {
	return l.Admin(func(s *store.Store) error { return s.DeletePolicy(ctx, id) })
}

// allowHost makes the store's user and role of a new host (the store
// enables authentication as it starts; see store.Embedded), waiting for
// the store to come up.
func (l *Lab) allowHost(ctx context.Context, name string) error {
	if l.Config.EtcdInsecure {
		return nil
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := l.Admin(func(s *store.Store) error {
			if on, err := s.AuthEnabled(ctx); err != nil || !on {
				return errors.Join(err, errors.New("authentication not on yet"))
			}
			return s.AllowHost(ctx, name)
		})
		if err == nil || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Open reads the state of a running lab.
func Open(name string) (*Lab, error) {
	if name == "" {
		name = DefaultName
	}
	data, err := os.ReadFile(filepath.Join(Dir(name), "state.json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no lab named %q is up (skiff lab up --name %s)", name, name)
	}
	if err != nil {
		return nil, fmt.Errorf("read lab state: %w", err)
	}
	l := &Lab{}
	if err := json.Unmarshal(data, l); err != nil {
		return nil, fmt.Errorf("lab state %s is corrupt (skiff lab down --name %s clears it): %w", Dir(name), name, err)
	}
	return l, nil
}

// List returns the names of labs that have a run directory.
func List() []string {
	entries, _ := os.ReadDir(RunDir)
	var out []string
	for _, e := range entries {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out
}

func (l *Lab) save() error {
	data, _ := json.MarshalIndent(l, "", "  ")
	tmp := filepath.Join(l.dir(), "state.json.tmp")
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("save lab state: %w", err)
	}
	return os.Rename(tmp, filepath.Join(l.dir(), "state.json"))
}

// Up builds a lab. If anything fails, what was built is torn down again.
func Up(ctx context.Context, cfg Config) (*Lab, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("the lab needs root (network namespaces, veths, eBPF)")
	}
	l := &Lab{Config: cfg}
	l.Etcd = l.members()
	if _, err := os.Stat(l.dir()); err == nil {
		return nil, fmt.Errorf("lab %q is already up (skiff lab down --name %s, or choose another --name)", cfg.Name, cfg.Name)
	}
	if err := os.MkdirAll(l.dir(), 0o755); err != nil {
		return nil, fmt.Errorf("lab directory: %w", err)
	}
	err := l.build(ctx)
	if err != nil {
		if derr := Down(context.WithoutCancel(ctx), cfg.Name); derr != nil {
			err = errors.Join(err, fmt.Errorf("tear down half-built lab: %w", derr))
		}
		return nil, err
	}
	return l, nil
}

func (l *Lab) build(ctx context.Context) error {
	if err := l.save(); err != nil {
		return err
	}
	if err := l.buildSwitch(); err != nil {
		return err
	}
	if err := l.startEtcd(); err != nil {
		return err
	}
	if l.Config.Prepare != nil {
		if err := l.Config.Prepare(ctx, l); err != nil {
			return err
		}
	}
	for range l.Config.Hosts {
		if _, err := l.addHost(ctx, false); err != nil {
			return err
		}
	}
	if err := l.WaitReady(ctx, 60*time.Second); err != nil {
		return err
	}
	for _, h := range l.Hosts {
		if err := l.startSlimRouters(ctx, h); err != nil {
			return err
		}
	}
	for _, h := range slices.Clone(l.Hosts) {
		for range l.Config.ContainersPerHost {
			if _, err := l.AddContainer(ctx, h.Name); err != nil {
				return err
			}
		}
	}
	return l.save()
}

// AddHost adds a host to a running lab and waits for its agent.
func (l *Lab) AddHost(ctx context.Context) (string, error) {
	h, err := l.addHost(ctx, true)
	if err != nil {
		return "", err
	}
	return h.Name, l.save()
}

func (l *Lab) addHost(ctx context.Context, wait bool) (Host, error) {
	l.HostsMade++
	i := l.HostsMade
	if room := 254 - len(l.Etcd); i > room {
		return Host{}, fmt.Errorf("the lab underlay has room for %d hosts beside %d etcd members", room, len(l.Etcd))
	}
	ip := underlayNet.Addr().As4()
	ip[3] = byte(i)
	h := Host{Name: fmt.Sprintf("h%d", i), Netns: fmt.Sprintf("%sh%d", l.prefix(), i), UnderlayIP: netip.AddrFrom4(ip)}
	h.Socket = filepath.Join(l.dir(), h.Name, "skiffd.sock")
	if err := l.buildHost(h); err != nil {
		return Host{}, err
	}
	if err := l.allowHost(ctx, h.Name); err != nil {
		return Host{}, fmt.Errorf("store user of %s: %w", h.Name, err)
	}
	l.Hosts = append(l.Hosts, h)
	if err := l.startAgent(&l.Hosts[len(l.Hosts)-1]); err != nil {
		return Host{}, err
	}
	if err := l.save(); err != nil {
		return Host{}, err
	}
	if wait {
		if err := l.waitAgent(ctx, h, 30*time.Second); err != nil {
			return h, err
		}
		return h, l.startSlimRouters(ctx, h)
	}
	return h, nil
}

// Host returns the named host.
func (l *Lab) Host(name string) (*Host, error) {
	for i := range l.Hosts {
		if l.Hosts[i].Name == name {
			return &l.Hosts[i], nil
		}
	}
	return nil, fmt.Errorf("lab %s has no host %q", l.Config.Name, name)
}

// Container returns the named container ("h1/c2").
func (l *Lab) Container(name string) (*Container, error) {
	for i := range l.Containers {
		if l.Containers[i].Name == name {
			return &l.Containers[i], nil
		}
	}
	return nil, fmt.Errorf("lab %s has no container %q", l.Config.Name, name)
}

// IP returns a container's overlay address ("h1/c2") or a host's underlay
// address ("h1").
func (l *Lab) IP(target string) (netip.Addr, error) {
	if strings.Contains(target, "/") {
		c, err := l.Container(target)
		if err != nil {
			return netip.Addr{}, err
		}
		return c.IP, nil
	}
	h, err := l.Host(target)
	if err != nil {
		return netip.Addr{}, err
	}
	return h.UnderlayIP, nil
}

// Netns returns the network namespace of a host or container.
func (l *Lab) Netns(target string) (string, error) {
	if strings.Contains(target, "/") {
		c, err := l.Container(target)
		if err != nil {
			return "", err
		}
		return c.Netns, nil
	}
	h, err := l.Host(target)
	if err != nil {
		return "", err
	}
	return h.Netns, nil
}

// RuntimeCaps is the bounding set a container runtime gives a container by
// default (Docker's and containerd's): no CAP_NET_ADMIN, no CAP_SYS_ADMIN.
const RuntimeCaps = "-all,+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,+net_bind_service," +
	"+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap"

// Command returns a command that runs inside target's network namespace.
// In sockets mode a container's commands run as a runtime would start
// them: in the container's cgroup, with a runtime's default bounding set
// (RuntimeCaps), and with the socket shim preloaded, as a container image
// built for sockets mode would.
func (l *Lab) Command(ctx context.Context, target, name string, args ...string) (*exec.Cmd, error) {
	return l.CommandCaps(ctx, RuntimeCaps, target, name, args...)
}

// CommandCaps is Command with the bounding set caps (setpriv's syntax) for
// a sockets-mode container's command.
func (l *Lab) CommandCaps(ctx context.Context, caps, target, name string, args ...string) (*exec.Cmd, error) {
	ns, err := l.Netns(target)
	if err != nil {
		return nil, err
	}
	argv := append([]string{"ip", "netns", "exec", ns, name}, args...)
	c, _ := l.Container(target)
	if c == nil || c.Cgroup == "" {
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		l.slimEnv(cmd, c)
		return cmd, nil
	}
	argv = append([]string{"ip", "netns", "exec", ns, "setpriv", "--bounding-set", caps, "--", name}, args...)
	// The shell joins the cgroup, then becomes the command (same pid).
	cmd := exec.CommandContext(ctx, "sh", append([]string{"-c", `echo $$ > "$0/cgroup.procs" && exec "$@"`, c.Cgroup}, argv...)...)
	if l.Config.Runs("sockets") {
		cmd.Env = append(os.Environ(), "LD_PRELOAD="+l.Shim())
	}
	l.slimEnv(cmd, c)
	return cmd, nil
}

// SeccompCommand is Command for a program without the shim: it runs under
// skiff's seccomp filter (skiff-seccomp-exec), its listener handed to the
// host's skiffd, as a runtime does with skiff's seccomp profile.
func (l *Lab) SeccompCommand(ctx context.Context, target, name string, args ...string) (*exec.Cmd, error) {
	return l.SeccompCommandCaps(ctx, RuntimeCaps, target, name, args...)
}

// SeccompCommandCaps is SeccompCommand with the bounding set caps.
func (l *Lab) SeccompCommandCaps(ctx context.Context, caps, target, name string, args ...string) (*exec.Cmd, error) {
	c, err := l.Container(target)
	if err != nil {
		return nil, err
	}
	filter := filepath.Join(l.dir(), "seccomp.bpf")
	if _, err := os.Stat(filter); err != nil {
		if err := os.WriteFile(filter, seccomp.FilterBytes(), 0o644); err != nil {
			return nil, fmt.Errorf("seccomp filter: %w", err)
		}
	}
	cmd, err := l.CommandCaps(ctx, caps, target, filepath.Join(l.Config.BinDir, "skiff-seccomp-exec"), append([]string{
		"--filter", filter, "--socket", l.SeccompSocket(c.Host), "--id", c.ID, "--", name}, args...)...)
	if err != nil {
		return nil, err
	}
	cmd.Env = slices.DeleteFunc(cmd.Env, func(v string) bool { return strings.HasPrefix(v, "LD_PRELOAD=") })
	return cmd, nil
}

// SeccompSocket is where host's skiffd takes seccomp listeners.
func (l *Lab) SeccompSocket(host string) string {
	return filepath.Join(l.hostDir(host), "seccomp.sock")
}

// Listening returns the replaced listeners (sockets mode) of a container:
// they live in its host's namespace, not the container's.
func (l *Lab) Listening(ctx context.Context, target string) ([]netip.AddrPort, error) {
	if !strings.Contains(target, "/") {
		return nil, nil
	}
	c, err := l.Container(target)
	if err != nil {
		return nil, err
	}
	if l.Config.SlimRouters {
		return l.slimListeners(c, 0)
	}
	if !l.Config.Runs("sockets") {
		return nil, nil
	}
	return l.ListenersOf(ctx, c.Host, c.IP)
}

// ListenersOf returns the replaced listeners host's sockets layer holds
// for the container address ip.
func (l *Lab) ListenersOf(ctx context.Context, host string, ip netip.Addr) ([]netip.AddrPort, error) {
	h, err := l.Host(host)
	if err != nil {
		return nil, err
	}
	st, err := api.NewClient(h.Socket).Status(ctx)
	if err != nil {
		return nil, err
	}
	sk, err := sockets.StatusOf(st)
	if err != nil || sk == nil {
		return nil, err
	}
	var out []netip.AddrPort
	for _, s := range sk.Listeners {
		if ap, err := netip.ParseAddrPort(s); err == nil && ap.Addr() == ip {
			out = append(out, ap)
		}
	}
	return out, nil
}

// Shim is the socket shim containers preload in sockets mode.
func (l *Lab) Shim() string { return filepath.Join(l.Config.BinDir, "libskiff.so") }

// Mode is the data-plane mode the lab's agents run.
func (l *Lab) Mode() string { return l.Config.Mode }

// Healthy checks that every agent is up, reaches the store and has synced.
func (l *Lab) Healthy(ctx context.Context) error {
	var errs []error
	for _, h := range l.Hosts {
		st, err := api.NewClient(h.Socket).Status(ctx)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", h.Name, err))
		case !st.Ready:
			errs = append(errs, fmt.Errorf("%s: agent not ready (store: %v %s; sync: %s)", h.Name, st.StoreReachable, st.StoreError, st.SyncError))
		}
	}
	return errors.Join(errs...)
}

// WaitReady waits until every agent is healthy.
func (l *Lab) WaitReady(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		err := l.Healthy(ctx)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("lab not ready after %v: %w", timeout, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (l *Lab) waitAgent(ctx context.Context, h Host, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		st, err := api.NewClient(h.Socket).Status(ctx)
		if err == nil && st.Ready {
			return nil
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(l.dir(), h.Name, "skiffd.log"))
			return fmt.Errorf("agent on %s not ready after %v (status %+v, %v); its log:\n%s", h.Name, timeout, st, err, tail(log, 2000))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// FlushConntrack empties the connection-tracking tables of every namespace
// of the lab. A benchmark cell of short connections leaves a table entry
// per connection for two minutes (TIME_WAIT); a following cell would pay
// for the full table (early drop, dropped SYNs) instead of its own work.
func (l *Lab) FlushConntrack() error {
	return l.inNamespaces(func(name string, h *netlink.Handle) error {
		if err := h.ConntrackTableFlush(netlink.ConntrackTable); err != nil {
			return fmt.Errorf("flush conntrack in %s: %w", name, err)
		}
		return nil
	})
}

// inNamespaces runs fn with a netlink handle in each of the lab's
// namespaces, all of them even when some fail.
func (l *Lab) inNamespaces(fn func(name string, h *netlink.Handle) error) error {
	var errs []error
	for _, name := range l.namespaces() {
		h, ns, err := handleAt(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		errs = append(errs, fn(name, h))
		h.Close()
		ns.Close()
	}
	return errors.Join(errs...)
}
