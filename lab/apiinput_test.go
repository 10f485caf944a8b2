package lab

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cni"
)

// pySquat binds the broker's abstract address in its netns (unprivileged,
// under setpriv), prints "bound" or "taken", then answers every connection
// as a broker would (a hello) and prints whether a shim sent it a request.
const pySquat = `
import socket, struct
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.bind("\0skiff-broker")
except OSError as e:
    print("taken", e.errno, flush=True)
    raise SystemExit
s.listen(16)
print("bound", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(1)
    try:
        c.send(struct.pack("=IIIB3xIIQ", 0x31464b53, 4, 0x0000f40a, 16, 0, 0, 1))
        m = c.recv(64)
    except OSError:
        m = b""
    print("request" if m else "no request", flush=True)
`

// pyEchoOnce connects to argv[1]:argv[2], echoes a line and prints "echo ok".
const pyEchoOnce = `
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.sendall(b"ping"); d = b""
while len(d) < 4:
    d += s.recv(4)
assert d == b"ping", d
print("echo ok", flush=True)
`

func squat(t *testing.T, l *Lab, target string) *proc {
	t.Helper()
	cmd, err := l.Command(context.Background(), target, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
		"/usr/bin/python3", "-c", pySquat) // not a $PATH python under /root
	if err != nil {
		t.Fatal(err)
	}
	return startProc(t, cmd, true)
}

// TestAPIInput: issue 25 item 7 in one sockets lab. The agent API refuses
// a container ID with "../" or of 100 000 characters as a bad request (400,
// CNI code 4) before doing anything: no broker, no file outside the state
// directory (before: the broker's files went where the ID pointed and a
// broker was restarted every 200 ms, and outlived DEL; the long ID got
// "try again later" for ever). A container's processes cannot take the
// broker's address: the agent holds it from ADD on, also across a broker's
// restart. A container whose address an unprivileged process took before
// ADD works on the overlay, the agent says why in its log, no broker
// crash-loops, and the shim does not talk to the impostor. A full subnet
// gives CNI code 100.
func TestAPIInput(t *testing.T) {
	l := newLab(t, Config{Name: "tapiin", Hosts: 1, ContainersPerHost: 2, Mode: "sockets",
		AgentArgs: []string{"--host-prefix", "28"}})
	ctx := context.Background()
	h1, _ := l.Host("h1")
	client := api.NewClient(h1.Socket)
	c1, _ := l.Container("h1/c1")
	const echo = 7400
	srv := startPy(t, l, "h1/c1", pyEcho, nil, "0.0.0.0", fmt.Sprint(echo))
	waitListener(t, l, "h1", netip.AddrPortFrom(c1.IP, echo), srv.exited)

	t.Run("bad IDs", func(t *testing.T) {
		ns := l.prefix() + "esc"
		if err := addNetns(ns); err != nil {
			t.Fatal(err)
		}
		defer l.killNetns(ctx, ns)
		cg, _ := l.cgroupDir()
		cg = filepath.Join(cg, "esc")
		if err := os.MkdirAll(cg, 0o755); err != nil {
			t.Fatal(err)
		}
		escape := fmt.Sprintf("skiff-apiesc-%d", os.Getpid())
		t.Cleanup(func() {
			files, _ := filepath.Glob(filepath.Join("/tmp", escape+"*"))
			for _, f := range files {
				os.Remove(f)
			}
		})
		for _, id := range []string{"../../../../../../../../../tmp/" + escape, "..", strings.Repeat("a", 100_000)} {
			req := api.AddRequest{ContainerID: id, IfName: "eth0", Netns: NetnsPath(ns), Cgroup: cg}
			_, err := client.AddEndpoint(ctx, req)
			var ae *api.Error
			if !errors.As(err, &ae) || ae.Status != http.StatusBadRequest {
				t.Errorf("ADD %.50q: %v, want a bad request (400)", id, err)
			}
			if err := client.DeleteEndpoint(ctx, req); !errors.As(err, &ae) || ae.Status != http.StatusBadRequest {
				t.Errorf("DEL %.50q: %v, want a bad request (400)", id, err)
			}
		}
		time.Sleep(500 * time.Millisecond) // a supervisor would have restarted a broker twice
		if files, _ := filepath.Glob(filepath.Join("/tmp", escape+"*")); len(files) > 0 {
			t.Errorf("files outside the state directory: %v", files)
		}
		if files, _ := filepath.Glob(filepath.Join(l.hostDir("h1"), "*.pid")); len(files) > 0 {
			t.Errorf("files outside the state directory: %v", files)
		}
		if pids := brokersMatching(escape); len(pids) > 0 {
			t.Errorf("brokers run for a refused ID: %v", pids)
		}
		eps, err := client.Endpoints(ctx, false)
		if err != nil || len(eps) != 2 {
			t.Errorf("endpoints %v (%v), want h1/c1 and h1/c2 only", eps, err)
		}
	})

	// Issue 40 item 7: a cgroup that is the root, climbs, holds skiffd,
	// or is another container's, and a MAC another container has, are
	// refused (400, CNI code 4) before anything is made.
	t.Run("cgroups and MACs", func(t *testing.T) {
		ns := l.prefix() + "dup"
		if err := addNetns(ns); err != nil {
			t.Fatal(err)
		}
		defer l.killNetns(ctx, ns)
		c2, _ := l.Container("h1/c2")
		var mac string
		eps, err := client.Endpoints(ctx, false)
		for _, e := range eps {
			if e.IP.Addr() == c2.IP {
				mac = e.MAC
			}
		}
		if err != nil || mac == "" {
			t.Fatalf("h1/c2's MAC: %v %v", eps, err)
		}
		own, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", h1.AgentPID))
		agentCg := "/"
		for _, line := range strings.Split(string(own), "\n") {
			if rest, ok := strings.CutPrefix(line, "0::"); ok {
				agentCg = rest
			}
		}
		t.Logf("skiffd's cgroup: %s", agentCg)
		for name, req := range map[string]api.AddRequest{
			"root":                  {Cgroup: "/"},
			"dot":                   {Cgroup: "."},
			"systemd root":          {Cgroup: "-.slice"},
			"climbs":                {Cgroup: "skiff/../.."},
			"another's cgroup":      {Cgroup: c1.Cgroup},
			"another's MAC":         {MAC: mac},
			"skiffd's own cgroup":   {Cgroup: agentCg},
			"above skiffd's cgroup": {Cgroup: filepath.Dir(agentCg)},
		} {
			if name != "root" && (agentCg == "/" || agentCg == "") && strings.Contains(name, "skiffd") {
				continue // the agent runs in the root cgroup: "root" covers it
			}
			req.ContainerID, req.IfName, req.Netns = "dup-"+strings.ReplaceAll(name, " ", "-"), "eth0", NetnsPath(ns)
			req.ContainerID = strings.ReplaceAll(req.ContainerID, "'", "")
			_, err := client.AddEndpoint(ctx, req)
			var ae *api.Error
			if !errors.As(err, &ae) || ae.Status != http.StatusBadRequest {
				t.Errorf("ADD with %s (%+v): %v, want a bad request (400)", name, req, err)
			}
		}
		if eps, err := client.Endpoints(ctx, false); err != nil || len(eps) != 2 {
			t.Errorf("endpoints %v (%v), want h1/c1 and h1/c2 only", eps, err)
		}
	})

	t.Run("address held", func(t *testing.T) {
		if got := squat(t, l, "h1/c1").line(t, 10*time.Second); !strings.HasPrefix(got, "taken") {
			t.Fatalf("an unprivileged process bound the broker's address of a running container: %q", got)
		}
		// across a broker's restart too, after an agent's restart: the
		// restarted agent takes the listener back from the running broker
		if err := l.StopAgent(ctx, "h1"); err != nil {
			t.Fatal(err)
		}
		if err := l.StartAgent(ctx, "h1"); err != nil {
			t.Fatal(err)
		}
		if err := l.WaitReady(ctx, 30*time.Second); err != nil {
			t.Fatal(err)
		}
		pid := brokerPID(t, l, "h1/c1")
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		if got := squat(t, l, "h1/c1").line(t, 10*time.Second); !strings.HasPrefix(got, "taken") {
			t.Fatalf("bound the broker's address while its broker was down: %q", got)
		}
		_, err := eventually(5*time.Second, func() error {
			if pids := brokersMatching(c1.ID + ".stats"); len(pids) != 1 || pids[0] == pid {
				return fmt.Errorf("brokers of %s: %v (the killed one: %d)", c1.ID, pids, pid)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond) // its pool filled
		before := counter(t, l, "h1", "connect_fast")
		if out := runPy(t, l, "h1/c2", pyEchoOnce, nil, c1.IP.String(), fmt.Sprint(echo)); !strings.Contains(out, "echo ok") {
			t.Fatalf("client: %q", out)
		}
		if counter(t, l, "h1", "connect_fast") == before {
			t.Error("the restarted broker's sockets were not used (connect_fast did not move)")
		}
	})

	t.Run("address squatted before ADD", func(t *testing.T) {
		i := l.nextContainerIndex("h1")
		c := Container{Name: fmt.Sprintf("h1/c%d", i), Host: "h1", Netns: fmt.Sprintf("%sh1-c%d", l.prefix(), i)}
		c.ID = c.Netns
		dir, _ := l.cgroupDir()
		c.Cgroup = filepath.Join(dir, fmt.Sprintf("h1-c%d", i))
		if err := os.MkdirAll(c.Cgroup, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := addNetns(c.Netns); err != nil {
			t.Fatal(err)
		}
		if err := tuneNetns(c.Netns); err != nil {
			t.Fatal(err)
		}
		l.Containers = append(l.Containers, c) // for l.Command; ADD below
		sq := squat(t, l, c.Name)
		if got := sq.line(t, 10*time.Second); got != "bound" {
			t.Fatalf("squatter: %q", got)
		}
		ip, err := l.cniAdd(ctx, c)
		if err != nil {
			t.Fatalf("ADD with the broker's address taken: %v", err)
		}
		l.Containers[len(l.Containers)-1].IP = ip
		if err := l.save(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second)
		log, _ := os.ReadFile(filepath.Join(l.hostDir("h1"), "skiffd.log"))
		var started, taken int
		for _, line := range strings.Split(string(log), "\n") {
			if !strings.Contains(line, c.ID) {
				continue
			}
			if strings.Contains(line, "socket broker started") {
				started++
			}
			if strings.Contains(line, "address is taken") {
				taken++
			}
		}
		if taken != 1 || started != 0 {
			t.Errorf("agent log for %s: %d lines saying the address is taken (want 1), %d broker starts (want 0)", c.ID, taken, started)
		}
		if out := runPy(t, l, c.Name, pyEchoOnce, nil, c1.IP.String(), fmt.Sprint(echo)); !strings.Contains(out, "echo ok") {
			t.Fatalf("client in the squatted container: %q", out)
		}
		time.Sleep(1500 * time.Millisecond) // the squatter's 1 s wait for a request
		if strings.Contains(sq.out.String(), "\nrequest") {
			t.Errorf("the shim talked to the squatter: %q", sq.out.String())
		}
		if err := l.RemoveContainer(ctx, c.Name); err != nil {
			t.Fatal(err)
		}
		if pids := brokersMatching(c.ID + ".stats"); len(pids) > 0 {
			t.Errorf("brokers outlive DEL: %v", pids)
		}
	})

	t.Run("addresses exhausted", func(t *testing.T) {
		var err error
		for range 20 {
			if _, err = l.AddContainer(ctx, "h1"); err != nil {
				break
			}
		}
		var ce *types.Error
		if !errors.As(err, &ce) || ce.Code != cni.ErrAddressesExhausted {
			t.Fatalf("ADD on a full /28: %v, want CNI code %d", err, cni.ErrAddressesExhausted)
		}
	})
}

// brokersMatching lists the pids of skiff-broker processes whose command
// line holds s.
func brokersMatching(s string) []int {
	var pids []int
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		cmdline, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		argv0, _, _ := strings.Cut(string(cmdline), "\x00")
		if filepath.Base(argv0) != "skiff-broker" || !strings.Contains(string(cmdline), s) {
			continue
		}
		var pid int
		fmt.Sscanf(filepath.Base(filepath.Dir(p)), "%d", &pid)
		pids = append(pids, pid)
	}
	return pids
}
