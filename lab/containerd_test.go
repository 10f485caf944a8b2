package lab

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestContainerd: Debian's containerd 1.6 with `ctr run --cni`, which
// reads the conflist from /etc/cni/net.d and plugins from /opt/cni/bin (it
// has no flags for either: the test puts its files there and removes them)
// and passes CNI_NETNS=/proc/<pid>/ns/net. 20 `ctr run --rm` cycles leave
// no endpoint; a container run with -d and removed
// without DEL (ctr sends none then) is released once its namespace is gone.
func TestContainerd(t *testing.T) {
	for _, bin := range []string{"containerd", "ctr"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s is not installed (make deps installs containerd)", bin)
		}
	}
	l := newLab(t, Config{Name: "tctrd", Hosts: 2, ContainersPerHost: 1, Mode: "auto"})
	ctx := context.Background()
	p := newPodman(t, l, "h1") // builds the busybox image
	dir := t.TempDir()
	archive := filepath.Join(dir, "bb.tar")
	p.run("save", "--format", "oci-archive", "-o", archive, "localhost/skiff-bb")

	conf := fmt.Sprintf("version = 2\nroot = %q\nstate = %q\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n[grpc]\n  address = %q\n",
		filepath.Join(dir, "root"), filepath.Join(dir, "state"), filepath.Join(dir, "containerd.sock"))
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	log, _ := os.Create(filepath.Join(dir, "containerd.log"))
	daemon := exec.Command("containerd", "--config", filepath.Join(dir, "config.toml"))
	daemon.Stdout, daemon.Stderr = log, log
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { daemon.Process.Kill(); daemon.Wait() })

	list, err := l.ConfList("h1")
	if err != nil {
		t.Fatal(err)
	}
	confFile := "/etc/cni/net.d/05-skiff-test-" + l.Config.Name + ".conflist"
	links := map[string]string{"/opt/cni/bin/skiff-cni": filepath.Join(l.Config.BinDir, "skiff-cni"), "/opt/cni/bin/portmap": filepath.Join(portmapDir(), "portmap")}
	for _, d := range []string{"/etc/cni/net.d", "/opt/cni/bin"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for link := range links {
		if _, err := os.Lstat(link); err == nil {
			t.Fatalf("%s exists already: the test does not replace what it did not make", link)
		}
	}
	if err := os.WriteFile(confFile, list, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(confFile) })
	for link, target := range links {
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(link) })
	}

	ns, _ := l.Netns("h1")
	ctr := func(args ...string) (string, error) {
		argv := append([]string{"--net=" + NetnsPath(ns), "--", "ctr", "-a", filepath.Join(dir, "containerd.sock")}, args...)
		out, err := exec.Command("nsenter", argv...).CombinedOutput()
		return string(out), err
	}
	if _, err := eventually(10*time.Second, func() error { _, err := ctr("version"); return err }); err != nil {
		t.Fatalf("containerd did not start: %v", err)
	}
	if out, err := ctr("images", "import", "--base-name", "localhost/skiff-bb", archive); err != nil {
		t.Fatalf("import: %v\n%s", err, out)
	}
	image := "localhost/skiff-bb:latest"
	peer, _ := l.IP("h2/c1")
	out, err := ctr("run", "--rm", "--cni", "--snapshotter", "native", image, "ctr-ping", "ping", "-c", "1", "-W", "2", peer.String())
	if err != nil || !strings.Contains(out, "1 packets received") {
		t.Fatalf("cross-host ping from a ctr container: %v\n%s", err, out)
	}
	client := agentOf(t, l, "h1")
	before, err := client.Endpoints(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		if out, err := ctr("run", "--rm", "--cni", "--snapshotter", "native", image, fmt.Sprintf("ctr-c%d", i), "true"); err != nil {
			t.Fatalf("cycle %d: %v\n%s", i, err, out)
		}
	}
	after, err := client.Endpoints(ctx, false)
	if err != nil || len(after) != len(before) {
		t.Errorf("endpoints after 20 ctr run --rm: %d (%v), before %d", len(after), err, len(before))
	}
	// -d, then removed without DEL: the namespace path (/proc/<pid>/ns/net)
	// goes with the task, and a reconcile releases the endpoint.
	if out, err := ctr("run", "-d", "--cni", "--snapshotter", "native", image, "ctr-d", "sleep", "600"); err != nil {
		t.Fatalf("run -d: %v\n%s", err, out)
	}
	if eps, err := client.Endpoints(ctx, false); err != nil || len(eps) != len(before)+1 {
		t.Fatalf("endpoints after run -d: %d (%v), want %d", len(eps), err, len(before)+1)
	}
	ctr("task", "kill", "-s", "KILL", "ctr-d")
	if _, err := eventually(10*time.Second, func() error { _, err := ctr("task", "delete", "ctr-d"); return err }); err != nil {
		t.Fatalf("task delete: %v", err)
	}
	ctr("container", "delete", "ctr-d")
	if _, err := eventually(40*time.Second, func() error {
		// A container's ADD makes a reconcile now; one runs every 30 s anyway.
		ctr("run", "--rm", "--cni", "--snapshotter", "native", image, "ctr-nudge", "true")
		eps, err := client.Endpoints(ctx, false)
		if err == nil && len(eps) != len(before) {
			err = fmt.Errorf("%d endpoints, want %d", len(eps), len(before))
		}
		return err
	}); err != nil {
		t.Errorf("the endpoint of a container removed without DEL: %v", err)
	}
}
