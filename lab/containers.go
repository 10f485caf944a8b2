package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/store"
)

// NetnsPath is where `ip netns` keeps named namespaces.
func NetnsPath(name string) string { return filepath.Join("/run/netns", name) }

// ConfList is the CNI network configuration list a runtime on host would
// use: skiff-cni, then the reference portmap plugin for port publishing
// (-p) when it is installed (Debian's containernetworking-plugins).
func (l *Lab) ConfList(host string) ([]byte, error) {
	h, err := l.Host(host)
	if err != nil {
		return nil, err
	}
	plugins := []map[string]any{{"type": "skiff-cni", "socket": h.Socket,
		"capabilities": map[string]bool{"cgroupPath": true, "ips": true, "mac": true, "bandwidth": true}}}
	if portmapDir() != "" {
		plugins = append(plugins, map[string]any{"type": "portmap", "snat": true,
			"capabilities": map[string]bool{"portMappings": true}})
	}
	return json.MarshalIndent(map[string]any{
		"cniVersion": "1.0.0", // what the runtimes of Debian 12 parse (README)
		"name":       "skiff",
		"plugins":    plugins,
	}, "", "  ")
}

// cniDirs are where distributions put the reference CNI plugins.
var cniDirs = []string{"/usr/lib/cni", "/opt/cni/bin"}

// pluginDir is the directory holding the reference CNI plugin p, or "".
func pluginDir(p string) string {
	for _, d := range cniDirs {
		if _, err := os.Stat(filepath.Join(d, p)); err == nil {
			return d
		}
	}
	return ""
}

// portmapDir is the directory holding the portmap plugin, or "".
func portmapDir() string { return pluginDir("portmap") }

// cni returns libcni set up as a runtime on host: its plugins run in the
// host's network namespace (where portmap writes its rules), never the
// machine's.
func (l *Lab) cni(host string) (*libcni.CNIConfig, *libcni.NetworkConfigList, error) {
	h, err := l.Host(host)
	if err != nil {
		return nil, nil, err
	}
	data, err := l.ConfList(host)
	if err != nil {
		return nil, nil, err
	}
	list, err := libcni.ConfListFromBytes(data)
	if err != nil {
		return nil, nil, fmt.Errorf("CNI config list: %w", err)
	}
	path := []string{l.Config.BinDir}
	if d := portmapDir(); d != "" {
		path = append(path, d)
	}
	exec := &hostExec{DefaultExec: invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: os.Stderr}}, netns: h.Netns}
	return libcni.NewCNIConfigWithCacheDir(path, filepath.Join(l.dir(), "cni-cache"), exec), list, nil
}

// hostExec runs CNI plugins inside a lab host's network namespace.
type hostExec struct {
	invoke.DefaultExec
	netns string
}

func (e *hostExec) ExecPlugin(ctx context.Context, path string, stdin []byte, env []string) ([]byte, error) {
	var out []byte
	var err error
	if nerr := inNetns(e.netns, func() error { out, err = e.DefaultExec.ExecPlugin(ctx, path, stdin, env); return nil }); nerr != nil {
		return nil, nerr
	}
	return out, err
}

func (l *Lab) nextContainerIndex(host string) int {
	n := 0
	for _, c := range l.Containers {
		if c.Host == host {
			i, _ := strconv.Atoi(strings.TrimPrefix(c.Name, host+"/c"))
			n = max(n, i)
		}
	}
	return n + 1
}

// AddContainer creates a container namespace on host and attaches it with
// skiff-cni through libcni, as containerd does. It returns the container's
// name ("h1/c3").
func (l *Lab) AddContainer(ctx context.Context, host string) (string, error) {
	names, _, err := l.AddContainers(ctx, host, 1)
	if err != nil {
		return "", err
	}
	return names[0], nil
}

// AddContainers creates n container namespaces on host and attaches them
// all at once, each ADD in a goroutine of its own (a burst, as a runtime
// starting many pods makes): their names, and how long each ADD took as
// libcni saw it. The containers whose ADD failed are removed again; the
// error names them.
func (l *Lab) AddContainers(ctx context.Context, host string, n int) ([]string, []time.Duration, error) {
	return l.AddContainersThen(ctx, host, n, nil)
}

// AddContainersThen is AddContainers with then run for each container
// right after its own ADD returned, in the ADD's goroutine (a probe that
// times how soon the container reaches another): took covers the ADD
// only. A container whose then failed stays; the error names it.
func (l *Lab) AddContainersThen(ctx context.Context, host string, n int, then func(Container) error) ([]string, []time.Duration, error) {
	if _, err := l.Host(host); err != nil {
		return nil, nil, err
	}
	first := l.nextContainerIndex(host)
	cs := make([]Container, 0, n)
	for i := first; i < first+n; i++ {
		c, err := l.newContainer(host, i)
		if err != nil {
			for _, c := range cs {
				l.dropContainer(c)
			}
			return nil, nil, err
		}
		cs = append(cs, c)
	}
	took := make([]time.Duration, n)
	errs, thenErrs := make([]error, n), make([]error, n)
	var wg sync.WaitGroup
	for i := range cs {
		wg.Go(func() {
			start := time.Now()
			cs[i].IP, errs[i] = l.cniAdd(ctx, cs[i])
			took[i] = time.Since(start)
			if errs[i] == nil && then != nil {
				thenErrs[i] = then(cs[i])
			}
		})
	}
	wg.Wait()
	var names []string
	for i, c := range cs {
		if errs[i] != nil {
			l.dropContainer(c)
			errs[i] = fmt.Errorf("attach %s: %w", c.Name, errs[i])
			continue
		}
		if thenErrs[i] != nil {
			errs[i] = fmt.Errorf("%s: %w", c.Name, thenErrs[i])
		}
		l.Containers = append(l.Containers, c)
		names = append(names, c.Name)
	}
	return names, took, errors.Join(append(errs, l.save())...)
}

// newContainer makes container i of host: its namespace, and its cgroup
// when the lab runs host sockets.
func (l *Lab) newContainer(host string, i int) (Container, error) {
	c := Container{Name: fmt.Sprintf("%s/c%d", host, i), Host: host, Netns: fmt.Sprintf("%s%s-c%d", l.prefix(), host, i)}
	c.ID = c.Netns
	if l.Config.Runs("sockets") {
		// The runtime's job: a cgroup for the container, passed to CNI as
		// cgroupPath. Its broker creates the container's host sockets in it.
		dir, err := l.cgroupDir()
		if err != nil {
			return c, err
		}
		c.Cgroup = filepath.Join(dir, fmt.Sprintf("%s-c%d", host, i))
		if err := os.MkdirAll(c.Cgroup, 0o755); err != nil {
			return c, fmt.Errorf("cgroup for %s: %w", c.Name, err)
		}
	}
	if err := addNetns(c.Netns); err != nil {
		return c, err
	}
	if err := tuneNetns(c.Netns); err != nil {
		run("ip", "netns", "del", c.Netns)
		return c, err
	}
	return c, nil
}

// dropContainer removes what newContainer made for a container that was
// never attached.
func (l *Lab) dropContainer(c Container) {
	run("ip", "netns", "del", c.Netns)
	if c.Cgroup != "" {
		cgroup.Remove(c.Cgroup)
	}
}

func (l *Lab) runtimeConf(c Container) *libcni.RuntimeConf {
	rc := &libcni.RuntimeConf{ContainerID: c.ID, NetNS: NetnsPath(c.Netns), IfName: "eth0"}
	if c.Cgroup != "" {
		rc.CapabilityArgs = map[string]any{"cgroupPath": c.Cgroup}
	}
	return rc
}

// cgroupDir is the lab's cgroup v2 directory, parent of its containers'.
func (l *Lab) cgroupDir() (string, error) {
	root, err := cgroup.Root()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, "skiff-lab-"+l.Config.Name), nil
}

func (l *Lab) cniAdd(ctx context.Context, c Container) (netip.Addr, error) {
	// A freshly started agent may still be syncing: CNI error 11 means try
	// again later, and that is what a runtime does.
	for attempt := 0; ; attempt++ {
		ip, err := l.cniAddOnce(ctx, c)
		if err == nil || attempt > 50 || !strings.Contains(err.Error(), "try again later") {
			return ip, err
		}
		l.addRetries++
		time.Sleep(200 * time.Millisecond)
	}
}

// cniAddOnce runs CNI ADD once, as a runtime's single attempt.
func (l *Lab) cniAddOnce(ctx context.Context, c Container) (netip.Addr, error) {
	cc, list, err := l.cni(c.Host)
	if err != nil {
		return netip.Addr{}, err
	}
	res, err := cc.AddNetworkList(ctx, list, l.runtimeConf(c))
	if err != nil {
		return netip.Addr{}, err
	}
	cur, err := current.NewResultFromResult(res)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("CNI result: %w", err)
	}
	if len(cur.IPs) == 0 {
		return netip.Addr{}, errors.New("CNI result has no address")
	}
	ip, ok := netip.AddrFromSlice(cur.IPs[0].Address.IP.To4())
	if !ok {
		return netip.Addr{}, fmt.Errorf("CNI result address %v is not IPv4", cur.IPs[0].Address)
	}
	return ip, nil
}

// CheckContainer runs CNI CHECK for a container.
func (l *Lab) CheckContainer(ctx context.Context, name string) error {
	c, err := l.Container(name)
	if err != nil {
		return err
	}
	cc, list, err := l.cni(c.Host)
	if err != nil {
		return err
	}
	return cc.CheckNetworkList(ctx, list, l.runtimeConf(*c))
}

// RemoveContainer detaches a container with CNI DEL and deletes its namespace.
func (l *Lab) RemoveContainer(ctx context.Context, name string) error {
	_, err := l.RemoveContainers(ctx, name)
	return err
}

// RemoveContainers removes the containers named all at once, each DEL in
// a goroutine of its own, and returns how long each DEL took as libcni saw
// it. Those whose removal failed stay in the lab; the error names them.
func (l *Lab) RemoveContainers(ctx context.Context, names ...string) ([]time.Duration, error) {
	cs := make([]Container, len(names))
	for i, name := range names {
		c, err := l.Container(name)
		if err != nil {
			return nil, err
		}
		cs[i] = *c
	}
	took := make([]time.Duration, len(cs))
	errs := make([]error, len(cs))
	var wg sync.WaitGroup
	for i := range cs {
		wg.Go(func() {
			start := time.Now()
			errs[i] = l.removeContainer(ctx, cs[i])
			took[i] = time.Since(start)
		})
	}
	wg.Wait()
	gone := map[string]bool{}
	for i, c := range cs {
		gone[c.Name] = errs[i] == nil
	}
	l.Containers = slices.DeleteFunc(l.Containers, func(x Container) bool { return gone[x.Name] })
	return took, errors.Join(append(errs, l.save())...)
}

// removeContainer detaches c with CNI DEL and removes its namespace and
// cgroup.
func (l *Lab) removeContainer(ctx context.Context, c Container) error {
	cc, list, err := l.cni(c.Host)
	if err != nil {
		return err
	}
	if err := cc.DelNetworkList(ctx, list, l.runtimeConf(c)); err != nil {
		return fmt.Errorf("CNI DEL %s: %w", c.Name, err)
	}
	if err := l.killNetns(ctx, c.Netns); err != nil {
		return err
	}
	if c.Cgroup != "" {
		return cgroup.Remove(c.Cgroup)
	}
	return nil
}

// RemoveHost takes a host out of the cluster as an operator would: its agent
// stops, the administrator removes the host and its store user, and its
// namespaces go.
func (l *Lab) RemoveHost(ctx context.Context, name string) error {
	h, err := l.Host(name)
	if err != nil {
		return err
	}
	if err := stop(ctx, h.AgentPID, 5*time.Second); err != nil {
		return err
	}
	errs := []error{l.Admin(func(s *store.Store) error {
		return errors.Join(s.RemoveHost(ctx, name), s.RevokeHost(ctx, name))
	})}
	for _, c := range l.Containers {
		if c.Host == name {
			errs = append(errs, l.killNetns(ctx, c.Netns))
		}
	}
	// Unplug the cable now: the kernel destroys a deleted namespace (and the
	// veth in it) asynchronously.
	if sw, ns, err := handleAt(l.switchNetns()); err == nil {
		if link, err := sw.LinkByName(name); err == nil {
			errs = append(errs, sw.LinkDel(link))
		}
		sw.Close()
		ns.Close()
	}
	errs = append(errs, l.killNetns(ctx, h.Netns), os.RemoveAll(l.hostDir(name)), os.RemoveAll(l.bpfDir(name)))
	l.Containers = slices.DeleteFunc(l.Containers, func(c Container) bool { return c.Host == name })
	l.Hosts = slices.DeleteFunc(l.Hosts, func(x Host) bool { return x.Name == name })
	return errors.Join(append(errs, l.save())...)
}
