package lab

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/store"
)

// TestNetnsPathReused: a CNI_NETNS path that names another namespace
// after ADD (a /proc/PID/ns/net whose PID was reused; here a bind mount
// moved from namespace A to B) is never entered: CHECK fails saying so,
// DEL succeeds and removes the host veth, the endpoint and the lease, and
// B's eth0 survives.
func TestNetnsPathReused(t *testing.T) {
	l := newLab(t, Config{Name: "tnsid", Hosts: 1, ContainersPerHost: 0})
	ctx := context.Background()
	// The lab's prefix: a crashed run's namespaces and path go with Down.
	a, b := l.prefix()+"h1-nsa", l.prefix()+"h1-nsb"
	c := Container{Name: "h1/nsid", Host: "h1", Netns: l.prefix() + "h1-nsid"}
	c.ID = c.Netns
	path := NetnsPath(c.Netns)
	for _, ns := range []string{a, b} {
		if err := addNetns(ns); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { run("ip", "netns", "del", ns) })
	}
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
	ip, err := l.cniAdd(ctx, c)
	if err != nil {
		t.Fatalf("ADD: %v", err)
	}
	client := api.NewClient(l.Hosts[0].Socket)
	e, err := endpointOf(ctx, client, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	if e.NetnsIno == 0 {
		t.Errorf("ADD recorded no namespace identity: %+v", e)
	}
	// The path now names B, which has an eth0 of its own.
	if err := run("umount", path); err != nil {
		t.Fatal(err)
	}
	if err := run("mount", "--bind", NetnsPath(b), path); err != nil {
		t.Fatal(err)
	}
	if err := run("ip", "-n", b, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p"); err != nil {
		t.Fatal(err)
	}
	cc, list, err := l.cni("h1")
	if err != nil {
		t.Fatal(err)
	}
	if err := cc.CheckNetworkList(ctx, list, l.runtimeConf(c)); err == nil || !strings.Contains(err.Error(), "another network namespace") {
		t.Errorf("CHECK with the path naming another namespace: got %v, want an error saying so", err)
	}
	if err := cc.DelNetworkList(ctx, list, l.runtimeConf(c)); err != nil {
		t.Errorf("DEL: %v", err)
	}
	if err := run("ip", "-n", b, "link", "show", "eth0"); err != nil {
		t.Errorf("DEL deleted eth0 of a namespace it never configured: %v", err)
	}
	if err := run("ip", "-n", a, "link", "show", "eth0"); err == nil {
		t.Error("the container's own eth0 (in A) is still there")
	}
	veth := overlay.VethName(c.ID, "eth0")
	if err := l.Do("h1", func() error {
		if _, err := netlink.LinkByName(veth); err == nil {
			return fmt.Errorf("host veth %s still exists", veth)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	if _, err := endpointOf(ctx, client, c.ID); err == nil {
		t.Error("endpoint still in the store")
	}
	if err := l.Admin(func(s *store.Store) error {
		r, err := s.Client.Get(ctx, store.AddrKey("h1", e.IP.Masked(), ip))
		if err == nil && r.Count != 0 {
			err = fmt.Errorf("lease of %s still in the store", ip)
		}
		return err
	}); err != nil {
		t.Error(err)
	}
	// DEL again, also without a netns, as runtimes do: still success, and
	// B's eth0 still there.
	for _, ns := range []string{path, ""} {
		if err := client.DeleteEndpoint(ctx, api.AddRequest{ContainerID: c.ID, IfName: "eth0", Netns: ns}); err != nil {
			t.Errorf("DEL again (netns %q): %v", ns, err)
		}
	}
	if err := run("ip", "-n", b, "link", "show", "eth0"); err != nil {
		t.Errorf("a repeated DEL deleted eth0 of another namespace: %v", err)
	}
}

func endpointOf(ctx context.Context, client *api.Client, id string) (cluster.Endpoint, error) {
	eps, err := client.Endpoints(ctx, false)
	if err != nil {
		return cluster.Endpoint{}, err
	}
	for _, e := range eps {
		if e.ContainerID == id {
			return e, nil
		}
	}
	return cluster.Endpoint{}, fmt.Errorf("no endpoint of %s", id)
}
