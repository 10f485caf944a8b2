package lab

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestCleanup: skiffd --cleanup refuses while the agent runs; with it
// stopped, on a host that ran every layer with containers, host sockets
// and brokers, it removes every device, tc filter, iptables chain, pin,
// broker and state file skiff made in the host's namespace, says what it
// removed, and a second run finds nothing left.
func TestCleanup(t *testing.T) {
	l := newLab(t, Config{Name: "tclean", Hosts: 1, ContainersPerHost: 2, Mode: "auto"})
	dst, _ := l.IP("h1/c1")
	srv := startPy(t, l, "h1/c1", pyEcho, nil, dst.String(), "7000")
	to := netip.AddrPortFrom(dst, 7000)
	waitListener(t, l, "h1", to, srv.exited)
	appWaitRoute(t, l, "h1/c2", to, 10*time.Second)
	if out := runPy(t, l, "h1/c2", pyOnce, nil, dst.String(), "7000"); !strings.HasPrefix(out, "ok") {
		t.Fatalf("a host-socket connection before the cleanup: %s", out)
	}
	h, err := l.Host("h1")
	if err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(l.hostDir("h1"), "state")
	cleanup := func() (string, error) {
		// As the lab runs agents: nsenter keeps the machine's mounts
		// (ip netns exec would hide /sys/fs/bpf).
		cmd := exec.Command("nsenter", "--net="+NetnsPath(h.Netns), "--", filepath.Join(l.Config.BinDir, "skiffd"), "--cleanup",
			"--state-dir", state, "--bpf-dir", l.bpfDir("h1"), "--socket", h.Socket, "--seccomp-socket", l.SeccompSocket("h1"))
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := cleanup(); err == nil || !strings.Contains(out, "skiffd is running") {
		t.Fatalf("cleanup with the agent running: %v: %s", err, out)
	}
	brokers := brokersOf(t, h.Netns)
	if len(brokers) == 0 {
		t.Fatal("no broker runs in h1's namespace before the cleanup")
	}
	// The brokers' files are root's alone (issue 40 item 10).
	files, _ := filepath.Glob(filepath.Join(state, "brokers", "*"))
	for _, f := range append(files, filepath.Join(state, "brokers")) {
		if fi, err := os.Stat(f); err == nil && fi.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s: mode %o, readable by others", f, fi.Mode().Perm())
		}
	}
	if len(files) == 0 {
		t.Error("no broker state files")
	}
	if err := l.StopAgent(context.Background(), "h1"); err != nil {
		t.Fatal(err)
	}
	out, err := cleanup()
	if err != nil {
		t.Fatalf("cleanup: %v\n%s", err, out)
	}
	t.Logf("cleanup said:\n%s", out)
	for _, want := range []string{"removed device skiff0", "removed device skiff.vxlan", "removed iptables chain filter/SKIFF-FORWARD",
		"removed layer sockets", "removed layer cache", "removed pins in " + l.bpfDir("h1")} {
		if !strings.Contains(out, want) {
			t.Errorf("cleanup did not say %q", want)
		}
	}
	assertNothingLeft(t, l, h.Netns)
	for _, p := range []string{l.bpfDir("h1"), state, h.Socket} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s left", p)
		}
	}
	if out, err := cleanup(); err != nil || !strings.Contains(out, "nothing of skiff's left") {
		t.Errorf("a second cleanup: %v: %s", err, out)
	}
}

// assertNothingLeft checks that nothing skiff makes is left in host
// namespace netns: devices, iptables chains, tc filters on any device, the
// sockets layer's route, programs on the lab's containers' cgroups,
// brokers.
func assertNothingLeft(t *testing.T, l *Lab, netns string) {
	t.Helper()
	ns := func(args ...string) string {
		out, err := exec.Command("ip", append([]string{"netns", "exec", netns}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("%v: %v: %s", args, err, out)
		}
		return string(out)
	}
	for _, line := range strings.Split(strings.TrimSpace(ns("ip", "-o", "link", "show")), "\n") {
		dev, _, _ := strings.Cut(strings.Fields(line)[1], "@")
		dev = strings.TrimSuffix(dev, ":")
		if strings.HasPrefix(dev, "skiff") || strings.HasPrefix(dev, "skf") {
			t.Errorf("device left: %s", line)
		}
		for _, hook := range []string{"ingress", "egress"} {
			if f := ns("tc", "filter", "show", "dev", dev, hook); strings.Contains(f, "skiff-") {
				t.Errorf("tc filters left on %s %s:\n%s", dev, hook, f)
			}
		}
	}
	if rules := ns("iptables-save"); strings.Contains(rules, "SKIFF-") {
		t.Errorf("iptables chains left:\n%s", rules)
	}
	// The sockets layer's local route for its TOS on lo outlives the devices.
	if routes := ns("ip", "-o", "route", "show", "table", "all"); strings.Contains(routes, "tos 0x1c") {
		t.Errorf("the sockets layer's route left:\n%s", routes)
	}
	cgroups, err := l.cgroupDir()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("bpftool", "cgroup", "tree", cgroups).CombinedOutput(); err != nil {
		t.Errorf("bpftool cgroup tree: %v: %s", err, out)
	} else if progs := cgroupPrograms(string(out)); len(progs) > 0 {
		t.Errorf("programs left on the containers' cgroups: %v", progs)
	}
	if _, err := eventually(5*time.Second, func() error {
		if left := brokersOf(t, netns); len(left) > 0 {
			return fmt.Errorf("brokers left: %v", left)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
}

// cgroupPrograms lists the attached programs in bpftool cgroup tree's
// output: lines that start with a program id, under a cgroup's path.
func cgroupPrograms(tree string) []string {
	var progs []string
	for _, line := range strings.Split(tree, "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[0] != "CgroupPath" {
			if _, err := strconv.Atoi(f[0]); err == nil {
				progs = append(progs, strings.Join(f, " "))
			}
		}
	}
	return progs
}

// brokersOf lists the skiff-broker processes in netns ns (brokers and the
// keeper run in the host's namespace).
func brokersOf(t *testing.T, ns string) []int {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(NetnsPath(ns), &st); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("net:[%d]", st.Ino)
	var pids []int
	exes, _ := filepath.Glob("/proc/[0-9]*/exe")
	for _, exe := range exes {
		target, err := os.Readlink(exe)
		if err != nil || filepath.Base(target) != "skiff-broker" {
			continue
		}
		dir := filepath.Dir(exe)
		if n, err := os.Readlink(filepath.Join(dir, "ns", "net")); err == nil && n == want {
			var pid int
			fmt.Sscanf(filepath.Base(dir), "%d", &pid)
			pids = append(pids, pid)
		}
	}
	return pids
}
