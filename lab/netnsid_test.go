package lab

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/lab/labtest"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/store"
)

// TestNetnsPathReused: a CNI_NETNS path that names another namespace
// after ADD (a /proc/PID/ns/net whose PID was reused; here a bind mount
// moved from namespace A to B) is never entered. CHECK fails saying so;
// DEL succeeds and removes the host veth, the endpoint and the lease; a
// restarted agent's garbage collection releases such an endpoint without
// DEL; B's eth0 survives all of it.
func TestNetnsPathReused(t *testing.T) {
	l := newLab(t, Config{Name: "tnsid", Hosts: 1, ContainersPerHost: 0})
	ctx := context.Background()
	// The lab's prefix: a crashed run's namespaces and paths go with Down.
	a, b := l.prefix()+"h1-nsa", l.prefix()+"h1-nsb"
	for _, ns := range []string{a, b} {
		if err := addNetns(ns); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { run("ip", "netns", "del", ns) })
	}
	client := api.NewClient(l.Hosts[0].Socket)
	// attach ADDs a container whose netns path names A, then makes the
	// path name B. It returns the container and its endpoint.
	attach := func(name string) (Container, cluster.Endpoint) {
		t.Helper()
		c := Container{Name: "h1/" + name, Host: "h1", Netns: l.prefix() + "h1-" + name}
		c.ID = c.Netns
		path := NetnsPath(c.Netns)
		if err := os.WriteFile(path, nil, 0o444); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for run("umount", path) == nil {
			}
			os.Remove(path)
		})
		if err := run("mount", "--bind", NetnsPath(a), path); err != nil {
			t.Fatal(err)
		}
		if _, err := l.cniAdd(ctx, c); err != nil {
			t.Fatalf("ADD %s: %v", name, err)
		}
		e, err := endpointOf(ctx, client, c.ID)
		if err != nil {
			t.Fatal(err)
		}
		if e.NetnsIno == 0 {
			t.Errorf("ADD recorded no namespace identity: %+v", e)
		}
		if err := run("umount", path); err != nil {
			t.Fatal(err)
		}
		if err := run("mount", "--bind", NetnsPath(b), path); err != nil {
			t.Fatal(err)
		}
		return c, e
	}
	// gone checks that e's host side, endpoint and lease are gone and B's
	// eth0 is not.
	gone := func(what string, e cluster.Endpoint) {
		t.Helper()
		if err := run("ip", "-n", b, "link", "show", "eth0"); err != nil {
			t.Errorf("%s deleted eth0 of a namespace skiff never configured: %v", what, err)
		}
		if err := run("ip", "-n", a, "link", "show", "eth0"); err == nil {
			t.Errorf("after %s the container's own eth0 (in A) is still there", what)
		}
		if err := l.Do("h1", func() error {
			if _, err := netlink.LinkByName(e.Veth); err == nil {
				return fmt.Errorf("after %s host veth %s still exists", what, e.Veth)
			}
			return nil
		}); err != nil {
			t.Error(err)
		}
		if _, err := endpointOf(ctx, client, e.ContainerID); err == nil {
			t.Errorf("after %s the endpoint is still in the store", what)
		}
		if err := l.Admin(func(s *store.Store) error {
			r, err := s.Client.Get(ctx, store.AddrKey("h1", e.IP.Masked(), e.IP.Addr()))
			if err == nil && r.Count != 0 {
				err = fmt.Errorf("after %s the lease of %s is still in the store", what, e.IP)
			}
			return err
		}); err != nil {
			t.Error(err)
		}
	}

	c, e := attach("nsid")
	if err := run("ip", "-n", b, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p"); err != nil {
		t.Fatal(err)
	}
	cc, list, err := l.cni("h1")
	if err != nil {
		t.Fatal(err)
	}
	// CHECK fails: it says the path names another namespace, or (when a
	// reconcile's garbage collection, triggered by the ADD, came first and
	// released the endpoint, as it must) that the endpoint is gone, or
	// (caught between the two steps of that release) that its veth is.
	if err := cc.CheckNetworkList(ctx, list, l.runtimeConf(c)); err == nil ||
		!strings.Contains(err.Error(), "another network namespace") && !strings.Contains(err.Error(), "/eth0: not found") &&
			!strings.Contains(err.Error(), "host veth "+overlay.VethName(c.ID, "eth0")+": Link not found") {
		t.Errorf("CHECK with the path naming another namespace: got %v, want an error saying so", err)
	} else {
		t.Logf("CHECK: %v", err)
	}
	if err := cc.DelNetworkList(ctx, list, l.runtimeConf(c)); err != nil {
		t.Errorf("DEL: %v", err)
	}
	gone("DEL", e)
	// DEL again, also without a netns, as runtimes do: still success.
	for _, ns := range []string{NetnsPath(c.Netns), ""} {
		if err := client.DeleteEndpoint(ctx, api.AddRequest{ContainerID: c.ID, IfName: "eth0", Netns: ns}); err != nil {
			t.Errorf("DEL again (netns %q): %v", ns, err)
		}
	}
	gone("a repeated DEL", e)

	// The runtime never sends DEL (ctr run -d): the endpoint's namespace
	// is gone, whatever its path names now, and a reconcile (the one the
	// ADD set off, or the restarted agent's first) releases it.
	_, e = attach("nsid2")
	restartAgents(t, l, l.Config.Mode)
	if _, err := eventually(10*time.Second, func() error {
		_, err := endpointOf(ctx, client, e.ContainerID)
		if err == nil {
			return fmt.Errorf("endpoint %s not released by the restarted agent", e.ContainerID)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	gone("garbage collection", e)
}

func endpointOf(ctx context.Context, client *api.Client, id string) (cluster.Endpoint, error) {
	eps, err := client.Endpoints(ctx, false)
	if err != nil {
		return cluster.Endpoint{}, err
	}
	for _, e := range eps {
		if e.ContainerID == id {
			return e.Endpoint, nil
		}
	}
	return cluster.Endpoint{}, fmt.Errorf("no endpoint of %s", id)
}

// TestRuntimeInOtherMountNamespace: a runtime in a mount namespace of its
// own (podman under ip netns exec, rootless, in a container, a service with
// PrivateMounts) passes a namespace path skiffd cannot see. ADD, CHECK-free
// traffic and DEL work through the plugin's open descriptor of it; a
// reconcile does not take the endpoint for gone; DEL is idempotent. Before:
// ADD failed ("does not exist"), and DEL answered HTTP 500.
func TestRuntimeInOtherMountNamespace(t *testing.T) {
	l := newLab(t, Config{Name: "tmntns", Hosts: 2, ContainersPerHost: 1, Mode: "auto"})
	ctx := context.Background()
	h1, _ := l.Host("h1")
	bin := labtest.BinDir(t, "skiff-cni")
	dir := "/run/skiff-" + l.Config.Name + "-hidden"
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(dir) })
	conf := fmt.Sprintf(`{"cniVersion":"1.0.0","name":"skiff","type":"skiff-cni","socket":%q}`, h1.Socket)
	peer, _ := l.IP("h2/c1")
	// In a private mount namespace: a tmpfs only it sees, a network
	// namespace bound to a file on it, and the plugin run as a runtime
	// would, with that path.
	script := `set -e
mount -t tmpfs skiff-hidden "$DIR"
touch "$DIR/ns"
unshare --net="$DIR/ns" true
export CNI_CONTAINERID=hidden1 CNI_NETNS="$DIR/ns" CNI_IFNAME=eth0 CNI_PATH="$BIN"
CNI_COMMAND=ADD "$BIN/skiff-cni" <<<"$CONF"
nsenter --net="$DIR/ns" ping -c 1 -W 2 "$PEER" >/dev/null
sleep 1.5 # the endpoint's record made a reconcile: it must not take the endpoint for gone
nsenter --net="$DIR/ns" ping -c 1 -W 2 "$PEER" >/dev/null
echo reachable
CNI_COMMAND=DEL "$BIN/skiff-cni" <<<"$CONF"
CNI_COMMAND=DEL "$BIN/skiff-cni" <<<"$CONF"
echo deleted
`
	cmd := exec.CommandContext(ctx, "unshare", "--mount", "--propagation", "private", "bash", "-c", script)
	cmd.Env = append(os.Environ(), "DIR="+dir, "BIN="+bin, "CONF="+conf, "PEER="+peer.String())
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "reachable") || !strings.Contains(string(out), "deleted") {
		t.Fatalf("runtime in another mount namespace: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), `"ips"`) {
		t.Errorf("ADD printed no result:\n%s", out)
	}
	eps, err := agentOf(t, l, "h1").Endpoints(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range eps {
		if e.ContainerID == "hidden1" {
			t.Errorf("endpoint left after DEL: %+v", e.Endpoint)
		}
	}
	if err := run("ip", "netns", "exec", l.prefix()+"h1", "ip", "link", "show", overlay.VethName("hidden1", "eth0")); err == nil {
		t.Error("the host veth is left after DEL")
	}
}
