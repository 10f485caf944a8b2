package channels

import (
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/layer"
)

// pyOptOut connects a pair of loopback sockets, the listener or the client
// first marked with SKIFF_SO_NOCHANNEL (level 0x534b, name 2) as argv[1]
// says ("none", "listener", "client", "probe": only the option's answer),
// sends a message each way and prints "ok", or the option's refusal.
const pyOptOut = `
import socket, sys
which = sys.argv[1]
def mark(s):
    s.setsockopt(0x534b, 2, 1)
if which == "probe":
    try:
        mark(socket.socket())
        print("taken")
    except OSError as e:
        print("refused %d" % e.errno)
    sys.exit(0)
ln = socket.socket()
if which == "listener":
    mark(ln)
ln.bind(("127.0.0.1", 0))
ln.listen()
c = socket.socket()
if which == "client":
    mark(c)
c.connect(ln.getsockname())
a, _ = ln.accept()
c.sendall(b"ping")
assert a.recv(4) == b"ping"
a.sendall(b"pong")
assert c.recv(4) == b"pong"
print("ok")
`

// TestOptOut runs skch_setsockopt and skch_sockops in the kernel, on a
// cgroup of the test's own holding host sockets of a container (its
// loopback connections, in a namespace of the test's own): unmarked, both
// ends join the channel map and the messages go socket to socket; a
// socket that set SKIFF_SO_NOCHANNEL (as the seccomp agent's host sockets
// do) stays out, and so does every connection a marked listener accepts
// (the mark is cloned); outside the layer's cgroups the option is refused
// (ENOPROTOOPT), as on a host without the layer.
func TestOptOut(t *testing.T) {
	env := layer.Env{PinDir: bpffstest.Dir(t), Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("needs python3")
	}
	runtime.LockOSThread() // never unlocked: the thread ends with the test
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		t.Fatal(err)
	}
	lo, err := netlink.LinkByName("lo")
	if err == nil {
		err = netlink.LinkSetUp(lo)
	}
	if err != nil {
		t.Fatal(err)
	}
	root, err := cgroup.Root()
	if err != nil {
		t.Fatal(err)
	}
	cg := filepath.Join(root, fmt.Sprintf("skiff-test-optout-%d", os.Getpid()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cgroup.Remove(cg) })

	// The layer as skiffd starts it, on the test's cgroup instead of the
	// root, after the unshare: the thread's namespace is its host's.
	nl, err := newLayer(Options{CgroupRoot: cg})
	if err != nil {
		t.Fatal(err)
	}
	l := nl.(*Layer)
	if err := l.Start(t.Context(), env); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		l.Close()
		if _, err := teardown(env, nil); err != nil {
			t.Error(err)
		}
	})
	id, err := cgroup.ID(cg)
	if err != nil {
		t.Fatal(err)
	}
	ip := bpfmap.IPv4(netip.MustParseAddr("127.0.0.1"))
	if err := l.objs.SkchCgroups.Put(id, ip); err != nil {
		t.Fatal(err)
	}
	if err := l.objs.SkchIps.Put(ip, uint8(1)); err != nil {
		t.Fatal(err)
	}
	cgfd, err := unix.Open(cg, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(cgfd)
	run := func(inCgroup bool, which string) string {
		cmd := exec.Command(py, "-c", pyOptOut, which)
		if inCgroup {
			cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: cgfd}
		}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", which, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	if above := setsockoptAbove(t); above > 0 {
		// an auto lab of another package's test, run beside this one,
		// attaches its channels layer at the cgroup root
		t.Logf("the option outside the layer's cgroups not checked: %d setsockopt programs already apply to this process's cgroup", above)
	} else if got, want := run(false, "probe"), fmt.Sprintf("refused %d", unix.ENOPROTOOPT); got != want {
		t.Errorf("the option outside the layer's cgroups: %s, want %s", got, want)
	}
	if got := run(true, "probe"); got != "taken" {
		t.Errorf("the option in a container's cgroup: %s, want taken", got)
	}
	for _, c := range []struct {
		which           string
		added, optedOut uint64
		channelled      bool
	}{
		{"none", 2, 0, true},
		{"listener", 1, 1, false},
		{"client", 1, 1, false},
	} {
		before := l.Status(nil).Counters
		if got := run(true, c.which); got != "ok" {
			t.Fatalf("%s: %s", c.which, got)
		}
		after := l.Status(nil).Counters
		added, out, redirected := after["added"]-before["added"], after["opted_out"]-before["opted_out"], after["redirected"]-before["redirected"]
		if added != c.added || out != c.optedOut || (redirected >= 2) != c.channelled {
			t.Errorf("marked %s: %d sockets joined, %d opted out, %d messages redirected; want %d, %d, channelled %v",
				c.which, added, out, redirected, c.added, c.optedOut, c.channelled)
		}
	}
}

// setsockoptAbove counts the setsockopt programs in force for this
// process's cgroup (attached to it or above it).
func setsockoptAbove(t *testing.T) int {
	t.Helper()
	root, err := cgroup.Root()
	if err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(filepath.Join(root, cgroup.Own()), unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	res, err := link.QueryPrograms(link.QueryOptions{Target: fd, Attach: ebpf.AttachCGroupSetsockopt, QueryFlags: unix.BPF_F_QUERY_EFFECTIVE})
	if err != nil {
		t.Fatal(err)
	}
	return len(res.Programs)
}
