package lab

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/lab/labtest"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/store"
)

const echoPort = 7000

// TestConnectivity: TCP, UDP and ICMP between every pair of containers on 3
// hosts (same host and across hosts), and from containers to hosts.
func TestConnectivity(t *testing.T) {
	l := newLab(t, Config{Name: "tconn", Hosts: 3, ContainersPerHost: 2})
	ctx := context.Background()
	for _, c := range l.Containers {
		echoServer(t, l, c.Name, echoPort)
	}
	for _, h := range l.Hosts {
		echoServer(t, l, h.Name, echoPort)
	}
	for _, src := range l.Containers {
		for _, dst := range l.Containers {
			if src.Name == dst.Name {
				continue
			}
			to := netip.AddrPortFrom(dst.IP, echoPort)
			for _, network := range []string{"tcp4", "udp4"} {
				if err := exchange(l, src.Name, network, to); err != nil {
					t.Errorf("%s %s -> %s: %v", network, src.Name, dst.Name, err)
				}
			}
			if err := ping(ctx, l, src.Name, dst.IP); err != nil {
				t.Error(err)
			}
		}
		// Container to its own host and to every other host's underlay address.
		for _, h := range l.Hosts {
			if err := exchange(l, src.Name, "tcp4", netip.AddrPortFrom(h.UnderlayIP, echoPort)); err != nil {
				t.Errorf("tcp %s -> host %s: %v", src.Name, h.Name, err)
			}
		}
	}
	// A host reaches containers on other hosts over the overlay.
	if err := ping(ctx, l, "h1", l.Containers[len(l.Containers)-1].IP); err != nil {
		t.Error(err)
	}
	// Full-size frames pass with DF set: the container MTU leaves room for VXLAN.
	dst, _ := l.IP("h3/c1")
	cmd, _ := l.Command(ctx, "h1/c1", "ping", "-c", "1", "-W", "2", "-M", "do", "-s", fmt.Sprint(1500-overlay.Overhead-28), dst.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("full-MTU ping: %v\n%s", err, out)
	}
	if err := l.CheckContainer(ctx, "h2/c2"); err != nil {
		t.Errorf("CNI CHECK: %v", err)
	}
	// The benchmark starts each cell with empty tables: the flows above go.
	if n := echoFlows(t, l); n == 0 {
		t.Error("no tracked echo flows before the flush")
	}
	if err := l.FlushConntrack(); err != nil {
		t.Fatal(err)
	}
	if n := echoFlows(t, l); n != 0 {
		t.Errorf("%d tracked echo flows after the flush", n)
	}
	execPassesSignals(t, l)
}

// execPassesSignals: a program started with skiff lab exec ends when the
// command gets SIGTERM.
func execPassesSignals(t *testing.T, l *Lab) {
	t.Helper()
	const marker = "1234.5" // sleep's argument, to find it by
	skiff := filepath.Join(labtest.BinDir(t, "skiff"), "skiff")
	cmd := exec.Command(skiff, "lab", "exec", "--name", l.Config.Name, "h1", "--", "sleep", marker)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sleeper := func() int {
		procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
		for _, p := range procs {
			if b, err := os.ReadFile(p); err == nil && string(b) == "sleep\x00"+marker+"\x00" {
				pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
				return pid
			}
		}
		return 0
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		if pid := sleeper(); pid != 0 {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	if _, err := eventually(5*time.Second, func() error {
		if sleeper() == 0 {
			return errors.New("sleep did not start")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 128+int(syscall.SIGTERM) {
			t.Errorf("skiff lab exec after SIGTERM: %v, want exit status %d", err, 128+int(syscall.SIGTERM))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("skiff lab exec still runs 10 s after SIGTERM")
	}
	if pid := sleeper(); pid != 0 {
		t.Errorf("the program (pid %d) runs on after skiff lab exec got SIGTERM", pid)
	}
}

// echoFlows counts the tracked flows to the echo port in the lab's namespaces.
func echoFlows(t *testing.T, l *Lab) int {
	t.Helper()
	n := 0
	err := l.inNamespaces(func(name string, h *netlink.Handle) error {
		flows, err := h.ConntrackTableList(netlink.ConntrackTable, netlink.FAMILY_V4)
		if err != nil {
			return fmt.Errorf("conntrack in %s: %w", name, err)
		}
		for _, f := range flows {
			if f.Forward.DstPort == echoPort {
				n++
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestUnderlayMTU: the container MTU follows the underlay's.
func TestUnderlayMTU(t *testing.T) {
	l := newLab(t, Config{Name: "tmtu", Hosts: 2, ContainersPerHost: 1, UnderlayMTU: 9000})
	var mtu int
	err := l.Do("h1/c1", func() error {
		link, err := netlink.LinkByName("eth0")
		if err == nil {
			mtu = link.Attrs().MTU
		}
		return err
	})
	if err != nil || mtu != 9000-overlay.Overhead {
		t.Fatalf("container MTU %d (%v), want %d", mtu, err, 9000-overlay.Overhead)
	}
	dst, _ := l.IP("h2/c1")
	cmd, _ := l.Command(context.Background(), "h1/c1", "ping", "-c", "1", "-W", "2", "-M", "do", "-s", fmt.Sprint(9000-overlay.Overhead-28), dst.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("jumbo ping: %v\n%s", err, out)
	}
}

// routeTo reports whether host has an overlay route to subnet.
func routeTo(l *Lab, host string, subnet netip.Prefix) (found bool, err error) {
	err = l.Do(host, func() error {
		routes, err := netlink.RouteList(nil, netlink.FAMILY_V4)
		for _, r := range routes {
			found = found || r.Dst != nil && r.Dst.String() == subnet.String()
		}
		return err
	})
	return found, err
}

// converges bounds how long the lab waits for a store change to reach
// every agent. Changes usually take a few milliseconds (the tests log
// it), but the tests run beside the other packages' on a busy 2-core
// machine: how fast it converges is for measurements, not a pass/fail
// bound.
const converges = 5 * time.Second

// TestHostJoinAndLeave: every other host gets routes to a new host, and
// loses them when the host leaves.
func TestHostJoinAndLeave(t *testing.T) {
	l := newLab(t, Config{Name: "tjoin", Hosts: 2, ContainersPerHost: 1})
	ctx := context.Background()
	name, err := l.AddHost(ctx)
	if err != nil {
		t.Fatal(err)
	}
	h3, _ := l.Host(name)
	st, err := api.NewClient(h3.Socket).Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	subnet := st.Host.Subnet
	// The agent reports ready once registered; the others converge from the watch.
	took, err := eventually(converges, func() error {
		for _, h := range []string{"h1", "h2"} {
			if ok, err := routeTo(l, h, subnet); !ok || err != nil {
				return fmt.Errorf("%s has no route to %s (%v)", h, subnet, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("join not reflected within %v: %v", converges, err)
	}
	t.Logf("join reflected in %v", took)
	c, err := l.AddContainer(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	ip, _ := l.IP(c)
	if err := ping(ctx, l, "h1/c1", ip); err != nil {
		t.Fatal(err)
	}
	if err := l.RemoveHost(ctx, name); err != nil {
		t.Fatal(err)
	}
	took, err = eventually(converges, func() error {
		for _, h := range []string{"h1", "h2"} {
			if ok, err := routeTo(l, h, subnet); ok || err != nil {
				return fmt.Errorf("%s still routes to %s (%v)", h, subnet, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("leave not reflected within %v: %v", converges, err)
	}
	t.Logf("leave reflected in %v", took)
	hosts, err := api.NewClient(l.Hosts[0].Socket).Hosts(ctx)
	if err != nil || len(hosts) != 2 {
		t.Fatalf("hosts after leave: %v %v", hosts, err)
	}
	switchKeepsAddress(t, l)
}

// switchKeepsAddress plugs a port with the lowest possible address into the
// underlay switch and takes it out again: the switch's address, which every
// host has in its ARP cache for etcd, must not follow its ports'.
func switchKeepsAddress(t *testing.T, l *Lab) {
	t.Helper()
	h, ns, err := handleAt(l.switchNetns())
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	defer h.Close()
	address := func() string {
		br, err := h.LinkByName("br0")
		if err != nil {
			t.Fatal(err)
		}
		return br.Attrs().HardwareAddr.String()
	}
	br, err := h.LinkByName("br0")
	if err != nil {
		t.Fatal(err)
	}
	before := address()
	port := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "tlow0", HardwareAddr: net.HardwareAddr{0, 0, 0, 0, 0, 1}}, PeerName: "tlow1"}
	if err := h.LinkAdd(port); err != nil {
		t.Fatal(err)
	}
	defer h.LinkDel(port)
	if err := h.LinkSetMaster(port, br); err != nil {
		t.Fatal(err)
	}
	joined := address()
	if err := h.LinkDel(port); err != nil {
		t.Fatal(err)
	}
	if left := address(); joined != before || left != before {
		t.Errorf("switch address %s, with a port of the lowest address %s, without it %s", before, joined, left)
	}
}

// TestAgentRestartKeepsTraffic: a TCP transfer survives restarts of the
// agents at both ends.
func TestAgentRestartKeepsTraffic(t *testing.T) {
	l := newLab(t, Config{Name: "trestart", Hosts: 2, ContainersPerHost: 1})
	s := startStream(t, l, "h1/c1", "h2/c1", 7100)
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	restartUnder(t, l, s, "h1", "h2")
	if err := s.finish(); err != nil {
		t.Fatalf("transfer failed: %v", err)
	}
	t.Logf("%d bytes transferred across two agent restarts", s.bytes())
}

// restartUnder restarts the hosts' agents one after the other while the
// stream s runs, which must progress all along.
func restartUnder(t *testing.T, l *Lab, s *stream, hosts ...string) {
	t.Helper()
	ctx := context.Background()
	for _, h := range hosts {
		if err := l.StopAgent(ctx, h); err != nil {
			t.Fatal(err)
		}
		if err := s.progresses(2 * time.Second); err != nil {
			t.Fatalf("transfer stalled while the agent on %s was down: %v", h, err)
		}
		if err := l.StartAgent(ctx, h); err != nil {
			t.Fatal(err)
		}
		if err := s.progresses(2 * time.Second); err != nil {
			t.Fatalf("transfer stalled after the agent on %s restarted: %v", h, err)
		}
	}
}

// TestCNIDelAndReAdd: DEL leaves no veth, no address and no endpoint; a new
// ADD reuses nothing stale.
func TestCNIDelAndReAdd(t *testing.T) {
	l := newLab(t, Config{Name: "tdel", Hosts: 2, ContainersPerHost: 2})
	ctx := context.Background()
	client := api.NewClient(l.Hosts[0].Socket)
	old, _ := l.Container("h1/c2")
	gone := *old
	veth := overlay.VethName(gone.ID, "eth0")
	if err := l.RemoveContainer(ctx, "h1/c2"); err != nil {
		t.Fatal(err)
	}
	err := l.Do("h1", func() error {
		if _, err := netlink.LinkByName(veth); err == nil {
			return fmt.Errorf("veth %s still exists", veth)
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
	eps, err := client.Endpoints(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range eps {
		if e.ContainerID == gone.ID || e.IP.Addr() == gone.IP {
			t.Errorf("endpoint left behind: %+v", e)
		}
	}
	// DEL again, as runtimes do, must succeed although everything is gone.
	if err := client.DeleteEndpoint(ctx, api.AddRequest{ContainerID: gone.ID, IfName: "eth0", Netns: NetnsPath(gone.Netns)}); err != nil {
		t.Errorf("second DEL: %v", err)
	}
	name, err := l.AddContainer(ctx, "h1")
	if err != nil {
		t.Fatal(err)
	}
	fresh, _ := l.Container(name)
	if fresh.IP == gone.IP {
		t.Errorf("new container got the just-released address %s", gone.IP)
	}
	if err := l.CheckContainer(ctx, name); err != nil {
		t.Errorf("CHECK of re-added container: %v", err)
	}
	if err := ping(ctx, l, "h2/c1", fresh.IP); err != nil {
		t.Error(err)
	}
	// The old address answers nowhere.
	if err := ping(ctx, l, "h2/c1", gone.IP); err == nil {
		t.Errorf("released address %s still answers", gone.IP)
	}
}

// TestPolicy: a deny rule blocks new connections across hosts; deleting it
// restores them.
func TestPolicy(t *testing.T) {
	l := newLab(t, Config{Name: "tpol", Hosts: 2, ContainersPerHost: 1})
	ctx := context.Background()
	echoServer(t, l, "h2/c1", echoPort)
	echoServer(t, l, "h2/c1", echoPort+1)
	src, _ := l.IP("h1/c1")
	dst, _ := l.IP("h2/c1")
	to := netip.AddrPortFrom(dst, echoPort)
	if err := exchange(l, "h1/c1", "tcp4", to); err != nil {
		t.Fatal(err)
	}
	// Written to the store by the administrator; takes effect on every host.
	rule := policy.Rule{ID: "no-echo", Priority: 10, Action: policy.Deny, Src: netip.PrefixFrom(src, 32), Dst: netip.PrefixFrom(dst, 32), Proto: policy.TCP, Port: echoPort}
	if err := l.PutPolicy(ctx, rule); err != nil {
		t.Fatal(err)
	}
	took, err := eventually(converges, func() error {
		if _, err := dial(l, "h1/c1", "tcp4", to, 300*time.Millisecond); err == nil {
			return errors.New("connection still allowed")
		}
		return nil
	})
	if err != nil {
		t.Fatalf("deny not in force within %v: %v", converges, err)
	}
	t.Logf("deny in force after %v", took)
	if err := exchange(l, "h1/c1", "tcp4", netip.AddrPortFrom(dst, echoPort+1)); err != nil {
		t.Errorf("another port was blocked too: %v", err)
	}
	if err := exchange(l, "h1/c1", "udp4", to); err != nil {
		t.Errorf("UDP to the port was blocked too: %v", err)
	}
	if err := l.DeletePolicy(ctx, "no-echo"); err != nil {
		t.Fatal(err)
	}
	if _, err := eventually(converges, func() error { return exchange(l, "h1/c1", "tcp4", to) }); err != nil {
		t.Fatalf("not restored within %v of deleting the rule: %v", converges, err)
	}
}

// TestStoreUnreachable: with etcd down the data path keeps forwarding, a
// restarted agent comes back from its cached identity, ADD asks the runtime
// to try again later, and everything recovers when etcd returns.
func TestStoreUnreachable(t *testing.T) {
	l := newLab(t, Config{Name: "tstore", Hosts: 2, ContainersPerHost: 1})
	ctx := context.Background()
	dst, _ := l.IP("h2/c1")
	if err := l.StopEtcd(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ping(ctx, l, "h1/c1", dst); err != nil {
		t.Fatalf("forwarding stopped with the store down: %v", err)
	}
	// An agent restarting without the store still starts and keeps the host working.
	h1, _ := l.Host("h1")
	if err := l.StopAgent(ctx, "h1"); err != nil {
		t.Fatal(err)
	}
	if err := l.startAgent(h1); err != nil {
		t.Fatal(err)
	}
	client := api.NewClient(h1.Socket)
	st, err := eventuallyStatus(client, func(s api.Status) bool { return !s.StoreReachable })
	if err != nil {
		t.Fatalf("agent without store: %+v %v", st, err)
	}
	if err := ping(ctx, l, "h1/c1", dst); err != nil {
		t.Fatalf("forwarding stopped after an agent restart without store: %v", err)
	}
	_, err = client.AddEndpoint(ctx, api.AddRequest{ContainerID: "x", IfName: "eth0", Netns: NetnsPath(l.Containers[0].Netns)})
	var apiErr *api.Error
	if !errors.As(err, &apiErr) || !apiErr.Retry {
		t.Fatalf("ADD with the store down: %v, want a retryable error", err)
	}
	if err := l.StartEtcd(); err != nil {
		t.Fatal(err)
	}
	if err := l.WaitReady(ctx, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	name, err := l.AddContainer(ctx, "h1")
	if err != nil {
		t.Fatal(err)
	}
	ip, _ := l.IP(name)
	if err := ping(ctx, l, "h2/c1", ip); err != nil {
		t.Fatal(err)
	}
}

func eventuallyStatus(c *api.Client, ok func(api.Status) bool) (api.Status, error) {
	var st api.Status
	_, err := eventually(20*time.Second, func() (err error) {
		st, err = c.Status(context.Background())
		if err == nil && !ok(st) {
			err = errors.New("not yet")
		}
		return err
	})
	return st, err
}

// TestAgentBadInput: skiffd refuses a cluster CIDR that overlaps the
// underlay, unknown flags, and store credentials it cannot use (another
// cluster's, another host's, a missing key, none), with a message naming
// the file; --etcd-insecure warns.
func TestAgentBadInput(t *testing.T) {
	l := newLab(t, Config{Name: "tbad", Hosts: 1, ContainersPerHost: 0})
	own, err := l.EtcdTLS("h1")
	if err != nil {
		t.Fatal(err)
	}
	op, _, err := store.EnsurePKI(t.TempDir()) // another cluster's CA
	if err != nil {
		t.Fatal(err)
	}
	foreign, _, err := op.EnsureClient("h1")
	if err != nil {
		t.Fatal(err)
	}
	tlsArgs := func(name string, c store.TLS) []string {
		return []string{"--name", name, "--underlay-interface", "eth0", "--etcd-endpoints", l.etcdURL(),
			"--etcd-cafile", c.CAFile, "--etcd-certfile", c.CertFile, "--etcd-keyfile", c.KeyFile}
	}
	noKey := own
	noKey.KeyFile = t.TempDir() + "/h1.key"
	for _, tc := range []struct {
		args []string
		want string
	}{
		{tlsArgs("h1", foreign), foreign.CAFile},
		{tlsArgs("h9", own), own.CertFile + ` is for "h1", not this host "h9"`},
		{tlsArgs("h1", noKey), noKey.KeyFile},
		{[]string{"--name", "h1", "--underlay-interface", "eth0", "--etcd-endpoints", l.etcdURL()}, "--etcd-cafile"},
		{[]string{"--name", "h1", "--underlay-interface", "eth0", "--etcd-endpoints", l.etcdURL(), "--etcd-insecure"}, "level=WARN msg=\"reaching the cluster store over plain HTTP"},
		{[]string{"--cluster-cidr", "10.99.0.0/16", "--underlay-interface", "eth0", "--etcd-endpoints", l.etcdURL()}, "overlaps the underlay"},
		{[]string{"--no-such-flag"}, "flag provided but not defined"},
		{[]string{"--underlay-rate", "fast"}, `invalid value "fast" for flag -underlay-rate`},
		{[]string{"--underlay-rate", "10bit"}, "below 8kbit"},
		{[]string{"--cluster-cidr", "banana", "--underlay-interface", "eth0"}, "--cluster-cidr"},
		{[]string{"--underlay-interface", "eth0"}, "no cluster store"},
		{[]string{"--underlay-interface", "nope0", "--etcd-endpoints", l.etcdURL()}, "nope0"},
	} {
		cmd, _ := l.Command(context.Background(), "h1", l.Config.BinDir+"/skiffd", append(tc.args, "--socket", t.TempDir()+"/s.sock", "--state-dir", t.TempDir())...)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || !strings.Contains(string(out), tc.want) {
			t.Errorf("skiffd %v: %v, output %q; want failure mentioning %q", tc.args, err, out, tc.want)
		}
	}
}

// TestPolicyEndsEstablishedFlow: a deny rule stops a flow that was already
// established, within 1 s.
func TestPolicyEndsEstablishedFlow(t *testing.T) {
	l := newLab(t, Config{Name: "tpolest", Hosts: 2, ContainersPerHost: 1})
	ctx := context.Background()
	s := startStream(t, l, "h1/c1", "h2/c1", 7200)
	if err := s.progresses(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	dst, _ := l.IP("h2/c1")
	rule := policy.Rule{ID: "cut", Priority: 1, Action: policy.Deny, Dst: netip.PrefixFrom(dst, 32), Proto: policy.TCP, Port: 7200}
	if err := l.PutPolicy(ctx, rule); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if err := s.progresses(time.Second); err == nil {
		t.Fatalf("the established flow still moves 1 s after the deny rule")
	}
	s.finish()
}

// TestUpBadFlags: a lab with a mode or cluster CIDR the agents would refuse
// fails at once, saying what is valid, and builds nothing. Before, --mode
// nope waited 60 s for agents that had exited and then said they were not
// ready.
func TestUpBadFlags(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Name: "tnope", Mode: "nope"}, "choose one of auto, overlay, cache, channels, sockets, steering"},
		{Config{Name: "tnope", ClusterCIDR: "10.99.0.0/16"}, "overlaps the lab's underlay"},
		{Config{Name: "tnope", ClusterCIDR: "10.244.0.0/28"}, "cluster CIDR"},
		{Config{Name: "tnope", EtcdMembers: 4}, "4 etcd members: choose 1, 3, 5 or 7"},
		{Config{Name: "tnope", EtcdMembers: 9}, "9 etcd members: choose 1, 3, 5 or 7"},
		{Config{Name: "tnope", EtcdMembers: -1}, "-1 etcd members: choose 1, 3, 5 or 7"},
	} {
		tc.cfg.BinDir = labtest.BinDir(t, "skiff", "skiffd", "skiff-cni")
		start := time.Now()
		_, err := Up(context.Background(), tc.cfg)
		if err == nil {
			Down(context.Background(), tc.cfg.Name)
			t.Fatalf("Up(%+v) succeeded", tc.cfg)
		}
		if took := time.Since(start); took > 2*time.Second || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Up(%+v) = %v after %v; want an error mentioning %q at once", tc.cfg, err, took, tc.want)
		}
		if _, err := os.Stat(Dir(tc.cfg.Name)); err == nil {
			t.Errorf("lab directory %s exists", Dir(tc.cfg.Name))
		}
	}
}
