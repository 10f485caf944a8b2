package sockets

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
)

// pyConnect connects a fresh TCP socket to each address:port argument and
// prints per argument "peer <address>:<port>" (where the socket really
// went) or "err <errno name>".
const pyConnect = `
import errno, select, socket, sys
for a in sys.argv[1:]:
    h, p = a.rsplit(":", 1)
    s = socket.socket()
    s.setblocking(False)
    r = s.connect_ex((h, int(p)))
    if r == errno.EINPROGRESS:
        select.select([], [s], [], 5)
        r = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if r == 0:
        print("peer %s:%d" % s.getpeername())
    else:
        print("err " + errno.errorcode[r])
    s.close()
`

// containerHost makes the test's thread a host of its own (a network
// namespace, discarded at the end, where the programs are loaded) with a
// container cgroup holding sock_create and connect4 (or the programs
// named), for a container at ipServer. The hosts' underlay addresses 10.99.0.1–3 are all this
// namespace's, with listeners on ports 80 and 81 that never accept.
// python runs a script in the container's cgroup.
func containerHost(t *testing.T, programs ...string) (l *dataPlane, python func(script string, args ...string) *exec.Cmd) {
	t.Helper()
	if len(programs) == 0 {
		programs = []string{"sock_create", "connect4"}
	}
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("needs python3")
	}
	ownNetns(t, testHost.UnderlayIP, netip.MustParseAddr("10.99.0.2"), netip.MustParseAddr("10.99.0.3"))
	for _, port := range []string{"80", "81"} {
		ln, err := net.Listen("tcp4", ":"+port)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
	}
	l = loadTest(t) // after the unshare: the thread's namespace is the host's

	root, err := cgroup.Root()
	if err != nil {
		t.Fatal(err)
	}
	cg := filepath.Join(root, fmt.Sprintf("skiff-test-%s-%d", strings.ToLower(t.Name()), os.Getpid()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cgroup.Remove(cg) })
	for _, name := range programs {
		p := l.cgroupPrograms()[name]
		lk, err := link.AttachCgroup(link.CgroupOptions{Path: cg, Attach: p.Attach, Program: p.Prog})
		if err != nil {
			t.Fatalf("attach %s: %v", name, err)
		}
		t.Cleanup(func() { lk.Close() })
	}
	id, err := cgroup.ID(cg)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.objs.SksContainers.Put(id, sksSksContainer{Ip: bpfmap.IPv4(ipServer)}); err != nil {
		t.Fatal(err)
	}
	cgfd, err := unix.Open(cg, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(cgfd) })
	return l, func(script string, args ...string) *exec.Cmd {
		cmd := exec.Command(py, append([]string{"-c", script}, args...)...)
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: cgfd}
		return cmd
	}
}

// TestConnectPolicy runs connect4 in the kernel: a process in a container's
// cgroup connects host sockets to published listeners, and the policy (the
// first matching rule decides) says which ones connect4 sends to the
// listener's host and which it refuses, so that the shim falls back to the
// overlay.
func TestConnectPolicy(t *testing.T) {
	l, python := containerHost(t)
	// connects runs the targets from a process of the container cgroup.
	connects := func(targets ...string) []string {
		t.Helper()
		out, err := python(pyConnect, targets...).CombinedOutput()
		if err != nil {
			t.Fatalf("connects: %v\n%s", err, out)
		}
		return strings.Split(strings.TrimSpace(string(out)), "\n")
	}
	h2 := cluster.Host{Name: "h2", UnderlayIP: netip.MustParseAddr("10.99.0.2"), Subnet: netip.MustParsePrefix("10.244.2.0/24")}
	h3 := cluster.Host{Name: "h3", UnderlayIP: netip.MustParseAddr("10.99.0.3"), Subnet: netip.MustParsePrefix("10.244.3.0/24")}
	listeners := []cluster.Listener{
		{Host: "h2", Addr: netip.MustParseAddrPort("10.244.2.9:80")},
		{Host: "h2", Addr: netip.MustParseAddrPort("10.244.2.9:81")},
		{Host: "h3", Addr: netip.MustParseAddrPort("10.244.3.7:80")},
	}
	targets := []string{"10.244.2.9:80", "10.244.2.9:81", "10.244.3.7:80", "10.244.3.7:82"}
	pfx := netip.MustParsePrefix
	openPort := policy.Rule{ID: "open-81", Priority: 1, Action: policy.Allow, Dst: pfx("10.244.2.9/32"), Proto: policy.TCP, Port: 81}
	closeHost := policy.Rule{ID: "close-h2", Priority: 2, Action: policy.Deny, Dst: pfx("10.244.2.0/24")}
	udpOnly := policy.Rule{ID: "udp", Priority: 3, Action: policy.Deny, Src: pfx("10.244.1.0/24"), Proto: policy.UDP}
	fromOther := policy.Rule{ID: "from-other", Priority: 0, Action: policy.Deny, Src: pfx("10.244.1.6/32"), Dst: pfx("10.244.3.0/24")}
	fromUs := fromOther
	fromUs.ID, fromUs.Src = "from-us", pfx("10.244.1.0/28")
	rangeH2 := policy.Rule{ID: "range-h2", Priority: 1, Action: policy.Deny, Dst: pfx("10.244.2.9/32"), Proto: policy.TCP, Port: 75, PortEnd: 80}
	rangeH3 := policy.Rule{ID: "range-h3", Priority: 1, Action: policy.Deny, Dst: pfx("10.244.3.0/24"), Proto: policy.TCP, Port: 80, PortEnd: 90}
	var tooMany []policy.Rule
	for i := range len(sksSksRules{}.Rules) + 1 {
		tooMany = append(tooMany, policy.Rule{ID: fmt.Sprintf("r%04d", i), Priority: 100, Action: policy.Deny, Proto: policy.TCP, Port: uint16(9000 + i)})
	}
	const (
		toH2  = "peer 10.99.0.2:80"
		toH2b = "peer 10.99.0.2:81"
		toH3  = "peer 10.99.0.3:80"
		eperm = "err EPERM"
	)
	for _, c := range []struct {
		name   string
		rules  []policy.Rule
		want   []string // per target
		denied uint64   // connect_denied counted
	}{
		// A destination without a published listener is refused whatever the policy.
		{"no rules", nil, []string{toH2, toH2b, toH3, eperm}, 0},
		{"first match decides", []policy.Rule{openPort, closeHost, udpOnly}, []string{eperm, toH2b, toH3, eperm}, 1},
		{"another source's rule", []policy.Rule{openPort, closeHost, fromOther}, []string{eperm, toH2b, toH3, eperm}, 1},
		{"this source's rule", []policy.Rule{openPort, closeHost, fromUs}, []string{eperm, toH2b, eperm, eperm}, 2},
		{"port ranges", []policy.Rule{rangeH2, rangeH3}, []string{eperm, toH2b, eperm, eperm}, 2},
		{"more rules than fit", tooMany, []string{eperm, eperm, eperm, eperm}, 3},
		{"the rules gone", nil, []string{toH2, toH2b, toH3, eperm}, 0},
	} {
		rules, err := policy.NewSet(c.rules)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Sync([]cluster.Host{testHost, h2, h3}, listeners, rules); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		before, _ := l.Stats()
		got := connects(targets...)
		after, _ := l.Stats()
		if strings.Join(got, ",") != strings.Join(c.want, ",") {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
		if d := after["connect_denied"] - before["connect_denied"]; d != c.denied {
			t.Errorf("%s: connect_denied +%d, want +%d", c.name, d, c.denied)
		}
		if after["stamped"]-before["stamped"] != uint64(len(targets)) {
			t.Errorf("%s: %d sockets stamped, want %d", c.name, after["stamped"]-before["stamped"], len(targets))
		}
	}
	// Without a policy in force (an agent that could not write one),
	// nothing connects on the fast path.
	if err := l.objs.SksPolicy.Delete(uint32(0)); err != nil {
		t.Fatal(err)
	}
	if got := connects(targets[0]); got[0] != eperm {
		t.Errorf("without a policy: %v", got)
	}
}

// pyHoldAll connects to each address:port argument, prints "up", waits for
// a line on stdin and then prints per connection whether it is still
// "open" or the errno name of its error (ECONNABORTED once destroyed).
const pyHoldAll = `
import errno, socket, sys
socks = []
for a in sys.argv[1:]:
    h, p = a.rsplit(":", 1)
    socks.append(socket.create_connection((h, int(p)), timeout=5))
print("up", flush=True)
sys.stdin.readline()
for s in socks:
    s.setblocking(False)
    try:
        s.recv(1)
        print("data")
    except BlockingIOError:
        print("open")
    except OSError as e:
        print(errno.errorcode[e.errno])
`

// TestDestroyBatches: more connections to end than sks_kill holds at once
// (here 2 per pass) are ended in passes, every one of them.
// holding publishes listeners on host h2 at the targets (overlay
// address:port) and starts, in the container's cgroup, pyHoldAll holding a
// fast-path connection to each; a line on stdin makes it report how each
// ended, into out.
func holding(t *testing.T, l *dataPlane, python func(string, ...string) *exec.Cmd, targets ...string) (stdin io.Writer, cmd *exec.Cmd, out *bytes.Buffer) {
	t.Helper()
	h2 := cluster.Host{Name: "h2", UnderlayIP: netip.MustParseAddr("10.99.0.2"), Subnet: netip.MustParsePrefix("10.244.2.0/24")}
	var srv []cluster.Listener
	for _, a := range targets {
		srv = append(srv, cluster.Listener{Host: "h2", Addr: netip.MustParseAddrPort(a)})
	}
	if err := l.Sync([]cluster.Host{testHost, h2}, srv, nil); err != nil {
		t.Fatal(err)
	}
	cmd = python(pyHoldAll, targets...)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out = &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cmd.Wait() })
	return in, cmd, out
}

func TestDestroyBatches(t *testing.T) {
	l, python := containerHost(t)
	targets := []string{"10.244.2.9:80", "10.244.2.9:81", "10.244.2.9:80", "10.244.2.9:81", "10.244.2.9:80"}
	stdin, cmd, out := holding(t, l, python, targets...)
	var cookies []uint64
	for deadline := time.Now().Add(5 * time.Second); len(cookies) < len(targets); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d connections up: %s", len(cookies), len(targets), out.String())
		}
		conns, err := l.conns()
		if err != nil {
			t.Fatal(err)
		}
		cookies = cookies[:0]
		for _, c := range conns {
			if c.Role == sksSksRoleSKS_CLIENT && c.State == 1 { // established
				cookies = append(cookies, c.Cookie)
			}
		}
	}
	if err := l.destroyBatches(cookies, 2); err != nil {
		t.Fatal(err)
	}
	stdin.Write([]byte("\n"))
	if err := cmd.Wait(); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	want := "up\n" + strings.Repeat("ECONNABORTED\n", len(targets))
	if out.String() != want {
		t.Errorf("connections after the destroy:\n%s\nwant\n%s", out.String(), want)
	}
	var cookie uint64
	var mark uint8
	if l.objs.SksKill.Iterate().Next(&cookie, &mark) {
		t.Errorf("sks_kill still marks %d", cookie)
	}
}

// pyAttempt defines attempt(f) for the scripts below: it calls f and prints
// "ok" or "err <errno name>".
const pyAttempt = `
import errno, socket
def attempt(f):
    try:
        f()
        print("ok")
    except OSError as e:
        print("err " + errno.errorcode[e.errno])
`

// pyBindOptions binds a replaced socket as a listener would, then one with
// SO_REUSEPORT, and sets IP_OPTIONS (a source route) on a third; it prints
// "ok" or "err <errno name>" for each.
const pyBindOptions = pyAttempt + `
attempt(lambda: socket.socket().bind(("0.0.0.0", 8080)))
def reuseport():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("0.0.0.0", 8081))
attempt(reuseport)
attempt(lambda: socket.socket().setsockopt(socket.SOL_IP, socket.IP_OPTIONS, bytes([131, 7, 4, 10, 99, 0, 3, 0])))
attempt(lambda: socket.socket().setsockopt(socket.IPPROTO_TCP, 19, 1))  # TCP_REPAIR
attempt(lambda: socket.socket().setsockopt(socket.SOL_SOCKET, 33, 1 << 20))  # SO_RCVBUFFORCE
attempt(lambda: socket.socket().setsockopt(socket.SOL_IP, 8, 1))  # IP_PKTINFO
attempt(lambda: socket.socket().setsockopt(socket.SOL_IP, 20, 1))  # IP_RECVORIGDSTADDR
`

// TestBindAndOptions runs bind4 and setsockopt in the kernel: a listener
// that would share its port (SO_REUSEPORT) is refused, so the shim gives
// the app a container socket, where the kernel shares ports; and secure
// mode refuses a source route, which would send the SYN elsewhere than
// where connect4 sent it, the options that need CAP_NET_ADMIN in the
// host's namespace (the test runs as root, who has it), and those that make
// IP_PKTOPTIONS show a packet's host addresses.
func TestBindAndOptions(t *testing.T) {
	_, python := containerHost(t, "sock_create", "bind4", "setsockopt")
	out, err := python(pyBindOptions).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if got, want := strings.Fields(string(out)), []string{"ok", "err", "EPERM", "err", "EPERM", "err", "EPERM", "err", "EPERM", "err", "EPERM", "err", "EPERM"}; !slices.Equal(got, want) {
		t.Fatalf("bind, bind with SO_REUSEPORT, IP_OPTIONS, TCP_REPAIR, SO_RCVBUFFORCE (as root), IP_PKTINFO, IP_RECVORIGDSTADDR: %q, want %q", got, want)
	}
}

// pyOriginalDst connects to its argument and prints what SO_ORIGINAL_DST
// answers.
const pyOriginalDst = `
import socket, sys
h, p = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((h, int(p)), timeout=5)
raw = s.getsockopt(socket.SOL_IP, 80, 16)  # SO_ORIGINAL_DST
print("%s:%d" % (socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big")))
`

// TestOriginalDst runs getsockopt in the kernel: conntrack's original
// destination of a fast-path connection is the listener's host address;
// the container sees the overlay address it connected to, as getpeername
// shows it.
func TestOriginalDst(t *testing.T) {
	l, python := containerHost(t, "sock_create", "connect4", "getsockopt")
	// conntrack tracks this namespace's connections once a rule needs it
	if out, err := exec.Command("iptables", "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT").CombinedOutput(); err != nil {
		t.Fatalf("iptables: %v: %s", err, out)
	}
	h2 := cluster.Host{Name: "h2", UnderlayIP: netip.MustParseAddr("10.99.0.2"), Subnet: netip.MustParsePrefix("10.244.2.0/24")}
	if err := l.Sync([]cluster.Host{testHost, h2}, []cluster.Listener{{Host: "h2", Addr: netip.MustParseAddrPort("10.244.2.9:80")}}, policy.Set{}); err != nil {
		t.Fatal(err)
	}
	before, _ := l.Stats()
	out, err := python(pyOriginalDst, "10.244.2.9:80").CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if got := strings.TrimSpace(string(out)); got != "10.244.2.9:80" {
		t.Errorf("SO_ORIGINAL_DST: %s, want the overlay address 10.244.2.9:80", got)
	}
	if after, _ := l.Stats(); after["origdst_shown"]-before["origdst_shown"] != 1 {
		t.Errorf("origdst_shown +%d, want +1", after["origdst_shown"]-before["origdst_shown"])
	}
}

// TestRemoveEndpointEndsSockets: removing a container ends the host sockets
// that carry its address (here connections its processes still hold), and
// forgets the address even when its cgroup is already gone.
func TestRemoveEndpointEndsSockets(t *testing.T) {
	l, python := containerHost(t)
	stdin, cmd, out := holding(t, l, python, "10.244.2.9:80", "10.244.2.9:80")
	for deadline := time.Now().Add(5 * time.Second); !strings.HasPrefix(out.String(), "up"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("connections not up: %s", out.String())
		}
	}
	if err := l.objs.SksServed.Put(bpfmap.IPv4(ipServer), uint8(1)); err != nil {
		t.Fatal(err)
	}
	held, other := sksSksKey{Ip: bpfmap.IPv4(ipServer), Port: 8080}, sksSksKey{Ip: bpfmap.IPv4(ipClient), Port: 8080}
	for _, k := range []sksSksKey{held, other} {
		if err := l.objs.SksBound.Put(k, uint64(7)); err != nil {
			t.Fatal(err)
		}
	}
	gone := cluster.Endpoint{ContainerID: "c-gone", IP: netip.PrefixFrom(ipServer, 24), Cgroup: "/nonexistent/c-gone"}
	if err := l.RemoveEndpoint(gone); err != nil {
		t.Fatal(err)
	}
	stdin.Write([]byte("\n"))
	if err := cmd.Wait(); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	if want := "up\nECONNABORTED\nECONNABORTED\n"; out.String() != want {
		t.Errorf("connections after the container's removal:\n%s\nwant\n%s", out.String(), want)
	}
	all, err := bpfmap.Entries[uint64, sksSksContainer](l.objs.SksContainers)
	if err != nil || len(all) != 0 {
		t.Errorf("containers left: %v (%v)", all, err)
	}
	var yes uint8
	if err := l.objs.SksServed.Lookup(bpfmap.IPv4(ipServer), &yes); err == nil {
		t.Error("the address is still marked served")
	}
	bound, err := bpfmap.Entries[sksSksKey, uint64](l.objs.SksBound)
	if _, ok := bound[other]; err != nil || len(bound) != 1 || !ok {
		t.Errorf("bound ports after the removal: %v (%v), want only the other container's", bound, err)
	}
}

// pyBindHolds binds a port and tries it again while the first socket
// holds it, after it closed, and once a socket listens there; it prints
// "ok" or "err <errno name>" for each.
const pyBindHolds = pyAttempt + `
a = socket.socket()
attempt(lambda: a.bind(("0.0.0.0", 8082)))
attempt(lambda: socket.socket().bind(("10.244.1.5", 8082)))
a.close()
b = socket.socket()
attempt(lambda: b.bind(("0.0.0.0", 8082)))
attempt(b.listen)
attempt(lambda: socket.socket().bind(("0.0.0.0", 8082)))
b.close()
attempt(lambda: socket.socket().bind(("0.0.0.0", 8082)))
`

// TestBindHoldsPort runs bind4, sockops and sock_release in the kernel: a
// port bound by a socket that does not listen yet is the socket's, as in
// the container's own namespace, until it closes; then the listener holds
// it, until it closes.
func TestBindHoldsPort(t *testing.T) {
	l, python := containerHost(t, "sock_create", "bind4", "sockops", "sock_release")
	out, err := python(pyBindHolds).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	want := []string{"ok", "err", "EADDRINUSE", "ok", "ok", "err", "EADDRINUSE", "ok"}
	if got := strings.Fields(string(out)); !slices.Equal(got, want) {
		t.Fatalf("bind, again, after the close, listen, bind again, after the listener closed: %q, want %q", got, want)
	}
	if bound, err := bpfmap.Entries[sksSksKey, uint64](l.objs.SksBound); err != nil || len(bound) != 0 {
		t.Errorf("ports still held after every socket closed: %v (%v)", bound, err)
	}
}

// pyDevice defines device(s): the device s is bound to, "-" for none.
const pyDevice = `
import socket
def device(s):
    return s.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, 16).rstrip(b"\0").decode() or "-"
`

// pyExposed listens on a replaced socket without binding it first, as a
// program that bypasses the shim can, then binds and listens as the shim
// does; it prints the device each listener is bound to ("-" for none).
const pyExposed = pyDevice + `
exposed = socket.socket()
exposed.listen()
print(device(exposed))
replaced = socket.socket()
replaced.bind(("0.0.0.0", 8083))
replaced.listen()
print(device(replaced))
`

// TestExposedListenerOnLo runs sockops in the kernel: a listener autobound
// on a host address is bound to lo before listen() returns, so no packet
// from the network reaches it while the agent ends it.
func TestExposedListenerOnLo(t *testing.T) {
	l, python := containerHost(t, "sock_create", "bind4", "sockops")
	before, _ := l.Stats()
	out, err := python(pyExposed).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if got, want := strings.Fields(string(out)), []string{"lo", "-"}; !slices.Equal(got, want) {
		t.Fatalf("devices of the exposed and the replaced listener: %q, want %q", got, want)
	}
	if after, _ := l.Stats(); after["listener_exposed"] != before["listener_exposed"]+1 {
		t.Errorf("listener_exposed %d → %d, want one more", before["listener_exposed"], after["listener_exposed"])
	}
}

// connectLocal publishes target as a listener of this host (no policy
// rules) and connects to it from the container's cgroup: pyConnect's line.
func connectLocal(t *testing.T, l *dataPlane, python func(string, ...string) *exec.Cmd, target netip.AddrPort) string {
	t.Helper()
	rules, err := policy.NewSet(nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Sync([]cluster.Host{testHost}, []cluster.Listener{{Host: testHost.Name, Addr: target}}, rules); err != nil {
		t.Fatal(err)
	}
	out, err := python(pyConnect, target.String()).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// TestSameHostRecordLeavesWithFailedConnect runs sockops in the kernel: a
// same-host client records its SYN itself, and a connect that fails (here
// refused: nothing listens at the port) takes the record with it, so a
// later plain SYN of the tuple on lo is the host's.
func TestSameHostRecordLeavesWithFailedConnect(t *testing.T) {
	l, python := containerHost(t, "sock_create", "connect4", "sockops")
	target := netip.MustParseAddrPort("10.244.1.9:8090") // a container of this host
	before, _ := l.Stats()
	if got := connectLocal(t, l, python, target); got != "err ECONNREFUSED" {
		t.Fatalf("connect to a port where nothing listens: %q", got)
	}
	if after, _ := l.Stats(); after["syn_recorded"] != before["syn_recorded"]+1 {
		t.Fatalf("syn_recorded %d → %d: the client did not record its SYN", before["syn_recorded"], after["syn_recorded"])
	}
	if left, err := bpfmap.Entries[sksSksTuple, sksSksPending](l.objs.SksSyns); err != nil || len(left) != 0 {
		t.Errorf("SYN records after the failed connect: %v (%v)", left, err)
	}
}

// TestSameHostUnrecordedRefused runs connect4 and sks_lookup in the kernel
// without sockops, as when a same-host client's SYN record is gone (a flood
// of pending connects evicted it from the per-CPU LRU): the connection is
// refused, never taken by the host's listener on the port, which listens on
// every address (before, the SYN went to the host's underlay address and
// the host's listener accepted it).
func TestSameHostUnrecordedRefused(t *testing.T) {
	l, python := containerHost(t, "sock_create", "connect4")
	ns, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	lk, err := link.AttachNetNs(int(ns.Fd()), l.objs.SksLookup)
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Close()
	target := netip.MustParseAddrPort("10.244.1.9:80") // a container of this host; the host listens on :80
	before, _ := l.Stats()
	if got := connectLocal(t, l, python, target); got != "err ECONNREFUSED" {
		t.Fatalf("same-host connect without its record: %q, want it refused (not the host's listener)", got)
	}
	after, _ := l.Stats()
	if after["connect_fast"] != before["connect_fast"]+1 || after["same_host_unrecorded"] == before["same_host_unrecorded"] {
		t.Errorf("connect_fast %d → %d, same_host_unrecorded %d → %d: want the connect sent to %v and its SYN refused there",
			before["connect_fast"], after["connect_fast"], before["same_host_unrecorded"], after["same_host_unrecorded"], SameHostAddr)
	}
}

// TestUnpublishedListenerOnLo runs sockops in the kernel: a listener the
// layer cannot publish (here sks_served is full, and the container's address
// is not in it) is bound to lo, where nothing reaches it and where the shim
// sees it when listen() returns (it then gives the app a container socket).
func TestUnpublishedListenerOnLo(t *testing.T) {
	l, python := containerHost(t, "sock_create", "bind4", "sockops")
	var one uint8 = 1
	for i := uint32(0); i < l.objs.SksServed.MaxEntries(); i++ {
		ip := [4]byte{198, 18, byte(i >> 8), byte(i)}
		if err := l.objs.SksServed.Put(ip, one); err != nil {
			t.Fatalf("filling sks_served: %v", err)
		}
	}
	before, _ := l.Stats()
	out, err := python(pyDevice + `
s = socket.socket()
s.bind(("0.0.0.0", 8084))
s.listen()
print(device(s))
`).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if got := strings.TrimSpace(string(out)); got != "lo" {
		t.Fatalf("device of the unpublished listener: %q, want lo", got)
	}
	after, _ := l.Stats()
	if after["listener_failed"] != before["listener_failed"]+1 || after["listener_added"] != before["listener_added"] {
		t.Errorf("listener_failed %d → %d, listener_added %d → %d: want one failed, none added",
			before["listener_failed"], after["listener_failed"], before["listener_added"], after["listener_added"])
	}
}

// pyOptset sets options on sockets and prints what the layer answers at
// (SKS_OPTSET_LEVEL, SKS_OPTSET_NAME): the bits of the options set.
const pyOptset = `
import socket
def optset(s):
    return int.from_bytes(s.getsockopt(0x534b, 1, 4), "little")
a = socket.socket()
a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
a.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
a.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)  # any other
b = socket.socket()
c = socket.socket()
try:
    c.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")  # any other, and refused
except PermissionError:
    pass
c.setsockopt(socket.IPPROTO_TCP, 25, 4096)  # TCP_NOTSENT_LOWAT, the last
print(optset(a), optset(b), optset(c))
`

// TestOptset: the layer records which options of optset.h a container's
// socket set and answers them, for the seccomp agent's swap (bits by the order of
// optset.h: SO_KEEPALIVE 1, TCP_NODELAY 9, TCP_NOTSENT_LOWAT 15, any
// other option 31).
func TestOptset(t *testing.T) {
	_, python := containerHost(t, "sock_create", "setsockopt", "getsockopt")
	// a container's sockets: in a namespace of their own
	cmd := python(pyOptset)
	cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWNET
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	want := fmt.Sprintf("%d 0 %d", 1<<1|1<<9|1<<31, 1<<15|1<<31)
	if got := strings.TrimSpace(string(out)); got != want {
		t.Fatalf("option sets %q, want %q", got, want)
	}
	// host sockets are never swapped: nothing recorded
	out, err = python(pyOptset).CombinedOutput()
	if got := strings.TrimSpace(string(out)); err != nil || got != "0 0 0" {
		t.Fatalf("host sockets' option sets %q (%v), want \"0 0 0\"", got, err)
	}
}

// pyQuota holds as many listeners as its argument allows, one more bind,
// a listen without a port, and, after one listener closed, one more: how
// many are published, what the bind did, and the devices of the other two.
const pyQuota = pyDevice + `
import sys
quota = int(sys.argv[1])
held = []
for i in range(quota):
    s = socket.socket()
    s.bind(("0.0.0.0", 20000 + i))
    s.listen()
    held.append(s)
out = [sum(device(s) == "-" for s in held)]
extra = socket.socket()
try:
    extra.bind(("0.0.0.0", 20000 + quota))
    out.append("bound")
except PermissionError:
    out.append("EPERM")
extra.close()
anyport = socket.socket()
anyport.bind(("0.0.0.0", 0))
anyport.listen()
out.append(device(anyport))
anyport.close()
held.pop().close()
again = socket.socket()
again.bind(("0.0.0.0", 20000 + quota))
again.listen()
out.append(device(again))
print(*out)
`

// TestListenerQuota runs bind4, sockops and sock_release in the kernel: a
// container's host sockets hold at most its quota of ports, bound or
// listening; past it a bind is refused (EPERM: the shim gives the app a
// container socket) and a listen without a port is left unpublished on lo,
// so the host-wide maps keep room for its neighbours. A closed listener
// gives its port back, and the count is 0 when every socket closed.
func TestListenerQuota(t *testing.T) {
	l, python := containerHost(t, "sock_create", "bind4", "sockops", "sock_release")
	quota := l.cfg.quota()
	before, _ := l.Stats()
	out, err := python(pyQuota, fmt.Sprint(quota)).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	want := []string{fmt.Sprint(quota), "EPERM", "lo", "-"}
	if got := strings.Fields(string(out)); !slices.Equal(got, want) {
		t.Fatalf("published of %d, the next bind, a listen on any port, a listen after a close: %q, want %q", quota, got, want)
	}
	if after, _ := l.Stats(); after["listen_quota"] != before["listen_quota"]+2 {
		t.Errorf("listen_quota %d → %d, want two more", before["listen_quota"], after["listen_quota"])
	}
	if n := l.Held(ipServer); n != 0 {
		t.Errorf("%d ports held after every socket closed", n)
	}
}
