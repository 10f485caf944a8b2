package overlay

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/skiffnet/skiff/cluster"
)

// swappableNetns makes two throwaway namespaces, each with a veth named
// eth0, and a path bound to the first; swap binds the path to the second.
// Everything is removed when the test ends.
func swappableNetns(t *testing.T) (path string, swap func(), nsB string) {
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v %s", args, err, out)
		}
	}
	prefix := fmt.Sprintf("skiff-ut-nsid-%d-", os.Getpid())
	a, b := prefix+"a", prefix+"b"
	path = filepath.Join("/run/netns", prefix+"path")
	for _, ns := range []string{a, b} {
		exec.Command("ip", "netns", "del", ns).Run()
		run("ip", "netns", "add", ns)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
		run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p")
	}
	if err := os.WriteFile(path, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for exec.Command("umount", path).Run() == nil {
		}
		os.Remove(path)
	})
	run("mount", "--bind", filepath.Join("/run/netns", a), path)
	return path, func() {
		run("umount", path)
		run("mount", "--bind", filepath.Join("/run/netns", b), path)
	}, b
}

func hasEth0(t *testing.T, ns string) bool {
	return exec.Command("ip", "-n", ns, "link", "show", "eth0").Run() == nil
}

func TestOpenNetnsChecksIdentity(t *testing.T) {
	path, swap, _ := swappableNetns(t)
	dev, ino, err := NetnsID(path)
	if err != nil || ino == 0 {
		t.Fatalf("NetnsID: %d/%d %v", dev, ino, err)
	}
	e := cluster.Endpoint{ContainerID: "c1", IfName: "eth0", Veth: "skvtestnsid", Netns: path, NetnsDev: dev, NetnsIno: ino}
	ns, err := OpenNetns(e)
	if err != nil {
		t.Fatalf("same namespace: %v", err)
	}
	ns.Close()
	swap()
	if _, err := OpenNetns(e); !errors.Is(err, ErrNetnsChanged) {
		t.Fatalf("after the swap: got %v, want ErrNetnsChanged", err)
	}
	unknown := e
	unknown.NetnsDev, unknown.NetnsIno = 0, 0
	if ns, err := OpenNetns(unknown); err != nil {
		t.Fatalf("unrecorded identity (an older record): %v", err)
	} else {
		ns.Close()
	}
	gone := e
	gone.Netns = path + "-missing"
	if _, err := OpenNetns(gone); !errors.Is(err, ErrNetnsGone) {
		t.Fatalf("missing path: got %v, want ErrNetnsGone", err)
	}
}

// RemoveEndpoint deletes the container side only in the namespace the
// endpoint was attached in.
func TestRemoveEndpointEntersOnlyItsNamespace(t *testing.T) {
	path, swap, b := swappableNetns(t)
	dev, ino, err := NetnsID(path)
	if err != nil {
		t.Fatal(err)
	}
	o := &Overlay{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	e := cluster.Endpoint{ContainerID: "c1", IfName: "eth0", Veth: "skvtestnsid", Netns: path, NetnsDev: dev, NetnsIno: ino}
	swap()
	for _, e := range []cluster.Endpoint{e, {ContainerID: "c1", IfName: "eth0", Veth: "skvtestnsid", Netns: path}} {
		if err := o.RemoveEndpoint(e); err != nil {
			t.Fatalf("RemoveEndpoint (recorded %d/%d): %v", e.NetnsDev, e.NetnsIno, err)
		}
		if !hasEth0(t, b) {
			t.Fatalf("RemoveEndpoint (recorded %d/%d) deleted eth0 of another namespace", e.NetnsDev, e.NetnsIno)
		}
	}
	// The namespace it was attached in: the container side goes.
	dev, ino, err = NetnsID(path)
	if err != nil {
		t.Fatal(err)
	}
	e.NetnsDev, e.NetnsIno = dev, ino
	if err := o.RemoveEndpoint(e); err != nil {
		t.Fatal(err)
	}
	if hasEth0(t, b) {
		t.Fatal("eth0 of the endpoint's own namespace is still there")
	}
}
