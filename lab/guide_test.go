package lab

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// guideNode is a lab host made a machine of its own, as docs/install.md
// assumes one: the host's network namespace and a mount namespace of its
// own (kept in a file) in which /etc, /opt, /usr/local and /var/lib are
// the machine's with the node's changes on top (overlays), /run/skiff is
// the node's, and /sys/fs/bpf a bpffs of its own.
type guideNode struct {
	name, host string
	netns      string // the lab host's
	dir        string
	skiffd     *exec.Cmd // what systemctl would run
}

func (n *guideNode) mntns() string { return filepath.Join(n.dir, "ns", "mnt") }

// run runs a shell command line on the node, in dir, as root's login
// shell would (/usr/local/bin first on the PATH).
func (n *guideNode) run(dir, line, stdin string) (string, error) {
	cmd := exec.Command("nsenter", "--mount="+n.mntns(), "--net="+NetnsPath(n.netns), "--",
		"sh", "-c", `cd "$0" && eval "$1"`, dir, line)
	cmd.Env = append(os.Environ(), "PATH=/usr/local/bin:/usr/local/go/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin")
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// newGuideNode makes lab host host the machine name.
func newGuideNode(t *testing.T, l *Lab, name, host string) *guideNode {
	h, err := l.Host(host)
	if err != nil {
		t.Fatal(err)
	}
	n := &guideNode{name: name, host: host, netns: h.Netns, dir: filepath.Join(t.TempDir(), name)}
	script := []string{"set -e", "mkdir -p /run/skiff", "mount --bind " + filepath.Join(n.dir, "run") + " /run/skiff",
		"mount -t bpf bpf /sys/fs/bpf"}
	for _, d := range []string{"etc", "opt", "usr/local", "var/lib"} {
		up, work := filepath.Join(n.dir, "upper", d), filepath.Join(n.dir, "work", d)
		for _, p := range []string{up, work} {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		script = append(script, fmt.Sprintf("mount -t overlay overlay -o lowerdir=/%s,upperdir=%s,workdir=%s /%s", d, up, work, d))
	}
	for _, d := range []string{"ns", "run", "home"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A namespace kept in a file needs a private mount to live on.
	ns := filepath.Join(n.dir, "ns")
	for _, args := range [][]string{{"mount", "--bind", ns, ns}, {"mount", "--make-private", ns}, {"touch", n.mntns()},
		{"unshare", "--mount=" + n.mntns(), "--propagation", "slave", "sh", "-c", strings.Join(script, "\n")}} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("node %s: %v: %v: %s", name, args, err, out)
		}
	}
	t.Cleanup(func() {
		n.stop(t)
		// A test that failed before the guide's removal leaves the
		// node's brokers (the lab takes down the rest with the namespace).
		for _, pid := range brokersOf(t, n.netns) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		exec.Command("umount", n.mntns()).Run()
		exec.Command("umount", "-l", ns).Run()
	})
	// A real host's underlay carries its default route (skiffd finds its
	// underlay interface by it).
	if out, err := exec.Command("ip", "-n", h.Netns, "route", "replace", "default", "via", SwitchAddr().String()).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	return n
}

// systemctl does what systemd would for the guide's `systemctl enable
// --now skiffd` (run the installed unit's ExecStart, and wait, as an
// operator would, until skiff status answers) and `systemctl disable
// --now skiffd` (SIGTERM to skiffd alone: KillMode=process).
func (n *guideNode) systemctl(t *testing.T, line string) {
	t.Helper()
	switch line {
	case "systemctl enable --now skiffd":
		unit, err := n.run("/", "cat /etc/systemd/system/skiffd.service", "")
		if err != nil {
			t.Fatalf("%s: the unit: %v: %s", n.name, err, unit)
		}
		start := regexp.MustCompile(`(?m)^ExecStart=(.+)$`).FindStringSubmatch(unit)
		if start == nil {
			t.Fatalf("%s: no ExecStart in the unit:\n%s", n.name, unit)
		}
		log, err := os.Create(filepath.Join(n.dir, "skiffd.log"))
		if err != nil {
			t.Fatal(err)
		}
		defer log.Close()
		n.skiffd = exec.Command("nsenter", append([]string{"--mount=" + n.mntns(), "--net=" + NetnsPath(n.netns), "--"},
			strings.Fields(start[1])...)...)
		n.skiffd.Stdout, n.skiffd.Stderr = log, log
		n.skiffd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := n.skiffd.Start(); err != nil {
			t.Fatalf("%s: %v", n.name, err)
		}
		if _, err := eventually(60*time.Second, func() error {
			out, err := n.run("/", "skiff status", "")
			if err != nil {
				return fmt.Errorf("%v: %s", err, out)
			}
			return nil
		}); err != nil {
			logs, _ := os.ReadFile(filepath.Join(n.dir, "skiffd.log"))
			t.Fatalf("%s: skiffd did not answer: %v\n%s", n.name, err, tail(logs, 3000))
		}
	case "systemctl disable --now skiffd":
		n.stop(t)
	default:
		t.Fatalf("%s: the test knows no %q", n.name, line)
	}
}

// stop stops the node's skiffd, if it runs.
func (n *guideNode) stop(t *testing.T) {
	if n.skiffd == nil {
		return
	}
	n.skiffd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- n.skiffd.Wait() }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Errorf("%s: skiffd did not stop on SIGTERM", n.name)
		n.skiffd.Process.Kill()
		<-done
	}
	n.skiffd = nil
}

// guideBlock is a fenced block of docs/install.md that names the nodes it
// is for: ```sh node1 node2 (commands, one a line) or ```ini
// node1:/etc/skiff/skiffd.conf (lines added to that file).
type guideBlock struct {
	lang, info, body string
}

var fence = regexp.MustCompile("(?ms)^```(sh|ini) ([^\\n]+)\\n(.*?)^```")

// TestInstallGuide follows docs/install.md on two lab hosts made machines
// of their own (guideNode), block by block as the guide gives them, its
// addresses the lab's: make install, node1's config and skiffd with the
// embedded store, node2's certificate, node2's config and skiffd, skiff
// hosts and skiff status; then containers on both hosts reach each other;
// then the guide's removal on both, after which nothing of skiff's is left
// but each node's config and node1's store.
func TestInstallGuide(t *testing.T) {
	l := newLab(t, Config{Name: "tguide", Hosts: 2, Mode: "auto"})
	ctx := context.Background()
	repo, _ := filepath.Abs("..")
	doc, err := os.ReadFile(filepath.Join(repo, "docs", "install.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	// Fresh machines: the lab's agents go, and what they made.
	nodes := map[string]*guideNode{}
	for i, host := range []string{"h1", "h2"} {
		h, _ := l.Host(host)
		if err := l.StopAgent(ctx, host); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("nsenter", "--net="+NetnsPath(h.Netns), "--", filepath.Join(l.Config.BinDir, "skiffd"), "--cleanup",
			"--state-dir", filepath.Join(l.hostDir(host), "state"), "--bpf-dir", l.bpfDir(host), "--socket", h.Socket,
			"--seccomp-socket", l.SeccompSocket(host)).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v: %s", host, err, out)
		}
		name := fmt.Sprintf("node%d", i+1)
		nodes[name] = newGuideNode(t, l, name, host)
		text = strings.ReplaceAll(text, fmt.Sprintf("10.0.0.%d", i+1), h.UnderlayIP.String())
	}
	var blocks []guideBlock
	for _, m := range fence.FindAllStringSubmatch(text, -1) {
		blocks = append(blocks, guideBlock{lang: m[1], info: m[2], body: m[3]})
	}
	if len(blocks) < 6 {
		t.Fatalf("docs/install.md has %d blocks for the nodes", len(blocks))
	}
	removal := blocks[len(blocks)-1]
	if !strings.Contains(removal.body, "skiff uninstall") {
		t.Fatalf("the guide's last block is not the removal:\n%s", removal.body)
	}
	outputs := map[string]string{}
	for _, b := range blocks[:len(blocks)-1] {
		t.Logf("```%s %s\n%s```", b.lang, b.info, b.body)
		guideBlockRun(t, nodes, b, repo, l.Config.BinDir, outputs)
	}
	for _, want := range []string{"node1", "node2"} {
		if !strings.Contains(outputs["skiff hosts"], want) {
			t.Errorf("skiff hosts does not list %s:\n%s", want, outputs["skiff hosts"])
		}
	}
	if !regexp.MustCompile(`ready:\s+true`).MatchString(outputs["skiff status"]) {
		t.Errorf("skiff status:\n%s", outputs["skiff status"])
	}

	// Containers on both hosts, through the nodes' agents, reach each other.
	for _, host := range []string{"h1", "h2"} {
		h, _ := l.Host(host)
		h.Socket = filepath.Join(nodes[map[string]string{"h1": "node1", "h2": "node2"}[host]].dir, "run", "skiffd.sock")
	}
	var containers []string
	for _, host := range []string{"h1", "h2"} {
		c, err := l.AddContainer(ctx, host)
		if err != nil {
			t.Fatalf("a container on %s: %v", host, err)
		}
		containers = append(containers, c)
	}
	echoServer(t, l, containers[1], echoPort)
	dst, _ := l.IP(containers[1])
	if _, err := eventually(10*time.Second, func() error {
		return l.Do(containers[0], func() error { return echoOnce(netip.AddrPortFrom(dst, echoPort)) })
	}); err != nil {
		t.Errorf("%s → %s: %v", containers[0], containers[1], err)
	}
	for _, c := range containers {
		if err := l.RemoveContainer(ctx, c); err != nil {
			t.Error(err)
		}
	}

	t.Logf("```%s %s\n%s```", removal.lang, removal.info, removal.body)
	guideBlockRun(t, nodes, removal, repo, l.Config.BinDir, outputs)
	for _, n := range nodes {
		assertNothingLeft(t, l, n.netns)
		const installed = "/usr/local/bin/skiff /usr/local/bin/skiffd /usr/local/bin/skiff-broker /usr/local/lib/skiff " +
			"/usr/local/share/doc/skiff /opt/cni/bin/skiff-cni /etc/cni/net.d/10-skiff.conflist /etc/systemd/system/skiffd.service"
		if out, err := n.run("/", "for f in "+installed+"; do test -e $f && echo $f; done; true", ""); err != nil || strings.TrimSpace(out) != "" {
			t.Errorf("%s: installed files left (%v):\n%s", n.name, err, out)
		}
		if out, err := n.run("/", "test -f /etc/skiff/skiffd.conf && ! test -e /var/lib/skiff/skiffd.sock", ""); err != nil {
			t.Errorf("%s: the config should stay: %v %s", n.name, err, out)
		}
	}
	if out, err := nodes["node1"].run("/", "test -d /var/lib/skiff/etcd", ""); err != nil {
		t.Errorf("node1's store should stay: %v %s", err, out)
	}
}

// guideBlockRun runs one block of the guide on the nodes it names: an ini
// block's lines are added to the file, a sh block's lines run one by one
// (make in the source tree, make install without its build step and from
// the test's binaries; systemctl as systemd would). Before node2's first
// block the certificate directory node1 made is copied over, as the guide
// says to.
func guideBlockRun(t *testing.T, nodes map[string]*guideNode, b guideBlock, repo, bin string, outputs map[string]string) {
	t.Helper()
	if b.lang == "ini" {
		name, path, ok := strings.Cut(b.info, ":")
		n := nodes[name]
		if !ok || n == nil {
			t.Fatalf("block %q: no node", b.info)
		}
		if out, err := n.run("/", "cat >> "+path, b.body); err != nil {
			t.Fatalf("%s: %s: %v: %s", name, path, err, out)
		}
		return
	}
	for _, name := range strings.Fields(b.info) {
		n := nodes[name]
		if n == nil {
			t.Fatalf("block %q: no node %s", b.info, name)
		}
		home := filepath.Join(n.dir, "home")
		if name == "node2" {
			pki := filepath.Join(nodes["node1"].dir, "home", "node2-pki")
			if _, err := os.Stat(pki); err == nil {
				if out, err := n.run("/", "test -d /etc/skiff/pki || { mkdir -p /etc/skiff && cp -r "+pki+" /etc/skiff/pki && chmod 0700 /etc/skiff/pki; }", ""); err != nil {
					t.Fatalf("copying node2-pki: %v: %s", err, out)
				}
			}
		}
		for _, line := range strings.Split(b.body, "\n") {
			line = strings.TrimSpace(line)
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			if strings.HasPrefix(line, "systemctl ") {
				n.systemctl(t, line)
				continue
			}
			dir := home
			if strings.HasPrefix(line, "make ") {
				dir = repo
				if strings.HasPrefix(line, "make install") {
					line = strings.Replace(line, "make install", "make -o build install BIN="+bin, 1)
				}
			}
			out, err := n.run(dir, line, "")
			t.Logf("%s$ %s\n%s", name, line, out)
			if err != nil {
				t.Fatalf("%s: %s: %v", name, line, err)
			}
			outputs[line] = out
		}
	}
}
