package lab

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cgroup"
)

// TestCgroupPathPerEndpoint: cgroupPath as a CRI runtime with the systemd
// cgroup driver passes it ("SLICE:PREFIX:NAME") gives the container host
// sockets; one that names no cgroup keeps that container on the cache and
// the overlay, says why (skiff endpoints), and never makes the host not
// ready (before: every reconcile failed until the container went). Both
// leave their cgroups removable.
func TestCgroupPathPerEndpoint(t *testing.T) {
	l := newLab(t, Config{Name: "tcgpath", Hosts: 2, ContainersPerHost: 1, Mode: "auto"})
	ctx := context.Background()
	root, err := cgroup.Root()
	if err != nil {
		t.Fatal(err)
	}
	slices := []string{filepath.Join(root, "skifftest.slice"), filepath.Join(root, "skifftest.slice", "skifftest-pod1.slice")}
	unit := filepath.Join(slices[1], "cri-containerd-good.scope")
	if err := os.MkdirAll(unit, 0o755); err != nil {
		t.Fatal(err)
	}
	client := agentOf(t, l, "h1")
	reqs := map[string]api.AddRequest{}
	for name, cg := range map[string]string{"good": "skifftest-pod1.slice:cri-containerd:good", "bad": "skifftest-nopod.slice:cri-containerd:bad"} {
		ns := l.prefix() + "cg" + name
		if err := addNetns(ns); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { run("ip", "netns", "del", ns) })
		req := api.AddRequest{ContainerID: "tcg-" + name, IfName: "eth0", Netns: NetnsPath(ns), Cgroup: cg}
		if _, err := client.AddEndpoint(ctx, req); err != nil {
			t.Fatalf("ADD with cgroupPath %s: %v", cg, err)
		}
		reqs[name] = req
	}
	t.Cleanup(func() {
		for _, req := range reqs {
			client.DeleteEndpoint(context.Background(), req)
		}
		for _, dir := range []string{unit, slices[1], slices[0]} {
			cgroup.Remove(dir)
		}
	})
	// Each ADD's endpoint record makes a reconcile (the agent watches its
	// endpoints), whose layers report tcg-bad's cgroup; the host is still
	// ready after it.
	if _, err := eventually(10*time.Second, func() error {
		eps, err := client.Endpoints(ctx, false)
		if err != nil {
			return err
		}
		seen := map[string]bool{}
		for _, e := range eps {
			path, why := paths(e)
			switch e.ContainerID {
			case "tcg-good":
				if path != "cache,channels,sockets" {
					return fmt.Errorf("systemd cgroupPath: layers %s (%s), want cache, channels and sockets", path, why)
				}
			case "tcg-bad":
				if path != "cache" || !strings.Contains(why, "sockets: cgroup skifftest-nopod.slice:cri-containerd:bad is not a cgroup v2 directory") ||
					!strings.Contains(why, "channels: cgroup skifftest-nopod.slice:cri-containerd:bad is not a cgroup v2 directory") {
					return fmt.Errorf("unusable cgroupPath: layers %s, off: %s", path, why)
				}
			}
			seen[e.ContainerID] = true
		}
		if !seen["tcg-good"] || !seen["tcg-bad"] {
			return fmt.Errorf("endpoints %v lack tcg-good or tcg-bad", seen)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if st, err := client.Status(ctx); err != nil || !st.Ready || st.SyncError != "" {
		t.Fatalf("host not ready with a container's unusable cgroupPath: %+v %v", st, err)
	}
	peer, _ := l.IP("h2/c1")
	for name := range reqs {
		if err := run("ip", "netns", "exec", l.prefix()+"cg"+name, "ping", "-c", "1", "-W", "2", peer.String()); err != nil {
			t.Errorf("%s cgroupPath: no traffic: %v", name, err)
		}
	}
	for name, req := range reqs {
		if err := client.DeleteEndpoint(ctx, req); err != nil {
			t.Errorf("DEL %s: %v", name, err)
		}
	}
	if err := cgroup.Remove(unit); err != nil {
		t.Errorf("the container's cgroup after DEL: %v", err)
	}
}

// TestCgroupReleasedAtDel: a runtime that removes a container's cgroup
// before CNI DEL (runc with cgroupfs, as ctr drives it) finds the broker
// still in it; DEL stops the broker and removes the cgroup it kept, so
// none is left behind (before: one per container).
func TestCgroupReleasedAtDel(t *testing.T) {
	l := newLab(t, Config{Name: "tcgrel", Hosts: 1, Mode: "auto"})
	ctx := context.Background()
	parent, err := l.cgroupDir()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(parent, "runc-like")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cgroup.Remove(dir) })
	ns := l.prefix() + "cgrel"
	if err := addNetns(ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { run("ip", "netns", "del", ns) })
	client := agentOf(t, l, "h1")
	req := api.AddRequest{ContainerID: "cgrel", IfName: "eth0", Netns: NetnsPath(ns), Cgroup: dir}
	if _, err := client.AddEndpoint(ctx, req); err != nil {
		t.Fatal(err)
	}
	if _, err := eventually(5*time.Second, func() error {
		for _, c := range socketsStatus(t, l, "h1").Containers {
			if c.ContainerID == "cgrel" && c.Broker {
				return nil
			}
		}
		return errors.New("no broker")
	}); err != nil {
		t.Fatal(err)
	}
	// The container's processes are gone; the runtime removes the cgroup.
	if err := os.Remove(dir); err == nil {
		t.Fatal("the cgroup was removable with the broker in it: the test shows nothing")
	}
	if err := client.DeleteEndpoint(ctx, req); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the container's cgroup is left after DEL: %v", err)
	}
}
