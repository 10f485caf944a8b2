package lab

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/overlay"
)

// podman runs Debian's podman (CNI backend, runc) as a runtime on a lab
// host: in the host's network namespace (nsenter: ip netns exec would hide
// the cgroup mounts runc needs under a fresh /sys), with storage,
// configuration and the CNI directory of the test's own.
type podman struct {
	t    *testing.T
	l    *Lab
	host string
	dir  string
}

func newPodman(t *testing.T, l *Lab, host string) *podman {
	t.Helper()
	if _, err := exec.LookPath("podman"); err != nil {
		t.Fatal("podman is not installed (make deps installs it)")
	}
	p := &podman{t: t, l: l, host: host, dir: t.TempDir()}
	conf, err := l.ConfList(host)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(p.dir, "cni"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(p.dir, "cni", "skiff.conflist"), conf, 0o644); err != nil {
		t.Fatal(err)
	}
	// No rlimits of podman's own (a machine without CAP_SYS_RESOURCE
	// cannot raise them), cgroupfs (no systemd needed), runc.
	containers := fmt.Sprintf(`[containers]
default_ulimits = []
[network]
network_backend = "cni"
cni_plugin_dirs = [%q, %q]
network_config_dir = %q
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
`, l.Config.BinDir, portmapDir(), filepath.Join(p.dir, "cni"))
	if err := os.WriteFile(filepath.Join(p.dir, "containers.conf"), []byte(containers), 0o644); err != nil {
		t.Fatal(err)
	}
	// An image of busybox-static, built here: no registry.
	rootfs := filepath.Join(p.dir, "rootfs", "bin")
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", "/bin/busybox", rootfs).CombinedOutput(); err != nil {
		t.Fatalf("busybox-static (make deps installs it): %v %s", err, out)
	}
	for _, c := range []string{"sh", "ping", "ip", "nc", "sleep", "cat", "true"} {
		os.Symlink("busybox", filepath.Join(rootfs, c))
	}
	p.run("sh", "-c", fmt.Sprintf("tar -C %s -c . | podman --root %s --runroot %s --storage-driver vfs import - localhost/skiff-bb",
		filepath.Join(p.dir, "rootfs"), filepath.Join(p.dir, "root"), filepath.Join(p.dir, "runroot")))
	t.Cleanup(func() {
		p.cmd("rm", "-af").Run()
		p.cmd("rmi", "-af").Run()
	})
	return p
}

// cmd is podman with the test's configuration, in the host's namespace.
func (p *podman) cmd(args ...string) *exec.Cmd {
	ns, _ := p.l.Netns(p.host)
	argv := append([]string{"--net=" + NetnsPath(ns), "--", "podman", "--root", filepath.Join(p.dir, "root"),
		"--runroot", filepath.Join(p.dir, "runroot"), "--storage-driver", "vfs"}, args...)
	if args[0] == "sh" { // a pipeline that calls podman itself
		argv = append([]string{"--net=" + NetnsPath(ns), "--"}, args...)
	}
	cmd := exec.Command("nsenter", argv...)
	cmd.Env = append(os.Environ(), "CONTAINERS_CONF="+filepath.Join(p.dir, "containers.conf"))
	return cmd
}

// run runs podman and returns its output, failing the test on an error.
func (p *podman) run(args ...string) string {
	p.t.Helper()
	out, err := p.cmd(args...).CombinedOutput()
	if err != nil {
		p.t.Fatalf("podman %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestPodman: Debian's podman 4.3 (CNI backend, runc) with the conflist
// skiff documents, run in the lab host's network namespace (nsenter
// --net): cross-host traffic, --ip and --mac-address, -p (portmap), and
// 20 create/remove cycles that leave no endpoint (nor its address lease,
// released with it) and no veth behind.
func TestPodman(t *testing.T) {
	l := newLab(t, Config{Name: "tpodman", Hosts: 2, ContainersPerHost: 1, Mode: "auto"})
	ctx := context.Background()
	p := newPodman(t, l, "h1")
	peer, _ := l.IP("h2/c1")
	out := p.run("run", "--rm", "--network", "skiff", "localhost/skiff-bb", "ping", "-c", "1", "-W", "2", peer.String())
	if !strings.Contains(out, "1 packets received") {
		t.Fatalf("cross-host ping from a podman container:\n%s", out)
	}
	st, err := agentOf(t, l, "h1").Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	asked := st.Host.Subnet.Masked().Addr().Next().Next().Next().Next().Next().Next().Next().Next().Next() // .9
	out = p.run("run", "--rm", "--network", "skiff", "--ip", asked.String(), "--mac-address", "02:42:0a:f4:00:09",
		"localhost/skiff-bb", "sh", "-c", "ip -4 addr show eth0; ip link show eth0")
	if !strings.Contains(out, asked.String()+"/") || !strings.Contains(out, "02:42:0a:f4:00:09") {
		t.Errorf("--ip %s --mac-address 02:42:0a:f4:00:09:\n%s", asked, out)
	}
	// -p: the container's port 7000 on h1's address, port 8080.
	p.run("run", "-d", "--name", "web", "--network", "skiff", "-p", "8080:7000", "localhost/skiff-bb",
		"nc", "-ll", "-p", "7000", "-e", "cat")
	h1, _ := l.IP("h1")
	if _, err := eventually(5*time.Second, func() error { return exchange(l, "h2", "tcp4", netip.AddrPortFrom(h1, 8080)) }); err != nil {
		t.Errorf("-p 8080:7000 from h2: %v", err)
	}
	p.run("rm", "-f", "web")

	// skiff's seccomp profile on podman's own, made as docs/seccomp.md
	// says (skiff seccomp-profile --base): podman hands the listener over,
	// skiffd takes the container's cgroup from the hand-off (podman passes
	// no cgroupPath) and the broker swaps a host socket in at connect: nc
	// reaches a replaced listener on h2 by a host-socket connection.
	profile, err := exec.Command(filepath.Join(l.Config.BinDir, "skiff"), "seccomp-profile", "--base",
		"/usr/share/containers/seccomp.json", "--listener", l.SeccompSocket("h1")).Output()
	if err != nil {
		t.Fatalf("skiff seccomp-profile: %v", err)
	}
	if err := os.WriteFile(filepath.Join(p.dir, "seccomp.json"), profile, 0o644); err != nil {
		t.Fatal(err)
	}
	to := netip.AddrPortFrom(peer, 7001)
	srv := startPy(t, l, "h2/c1", pyEcho, nil, peer.String(), "7001")
	waitListener(t, l, "h2", to, srv.exited)
	appWaitRoute(t, l, "h1/c1", to, 10*time.Second)
	fast := func() uint64 {
		st, err := agentOf(t, l, "h1").Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return countersIn(st, "sockets")["connect_fast"]
	}
	was := fast()
	out = p.run("run", "--rm", "--network", "skiff", "--security-opt", "seccomp="+filepath.Join(p.dir, "seccomp.json"),
		"localhost/skiff-bb", "sh", "-c", fmt.Sprintf("echo skiff-seccomp | nc -w 3 %s 7001", peer))
	if !strings.Contains(out, "skiff-seccomp") {
		t.Errorf("nc under skiff's seccomp profile in podman:\n%s", out)
	}
	log, _ := os.ReadFile(filepath.Join(l.hostDir("h1"), "skiffd.log"))
	if !strings.Contains(string(log), "endpoint cgroup recorded") || !strings.Contains(string(log), "seccomp listener passed to the broker") {
		t.Errorf("podman's container did not get its cgroup recorded and its broker:\n%s", tail(log, 2000))
	}
	if now := fast(); now == was {
		t.Errorf("nc's connection under the profile was no host socket (connect_fast %d, before %d)", now, was)
	}

	before, err := agentOf(t, l, "h1").Endpoints(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		p.run("run", "--rm", "--network", "skiff", "localhost/skiff-bb", "true")
	}
	after, err := agentOf(t, l, "h1").Endpoints(ctx, false)
	if err != nil || len(after) != len(before) {
		t.Errorf("endpoints after 20 podman run --rm: %d (%v), before %d", len(after), err, len(before))
	}
	ns, _ := l.Netns("h1")
	links, _ := exec.Command("ip", "netns", "exec", ns, "ip", "-o", "link", "show", "type", "veth").Output()
	if n := strings.Count(string(links), ": "+overlay.VethPrefix); n != len(before) {
		t.Errorf("%d veths on h1 after the cycles, want %d:\n%s", n, len(before), links)
	}
}
