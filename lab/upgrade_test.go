package lab

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/lab/labtest"
)

// upgradeFrom is the release an in-place upgrade starts from: v0.1.0,
// the commit whose `skiff version` said 0.1.0 (a commit, not the tag, so
// a clone without tags has it too).
const upgradeFrom = "ba13fa8"

// releaseBin returns the binaries of commit rev of this repository: make
// build in a detached worktree, once per commit, kept in
// /var/cache/skiff/release/REV (a few minutes cold). The test fails when
// the clone does not hold the commit.
func releaseBin(t *testing.T, rev string) string {
	t.Helper()
	cache := filepath.Join("/var/cache/skiff/release", rev)
	bin := filepath.Join(cache, "bin")
	if _, err := os.Stat(filepath.Join(bin, "skiffd")); err == nil {
		return bin
	}
	repo, _ := filepath.Abs("..")
	if out, err := exec.Command("git", "-C", repo, "cat-file", "-e", rev+"^{commit}").CombinedOutput(); err != nil {
		t.Fatalf("commit %s (release v0.1.0) is not in this clone: %v: %s", rev, err, out)
	}
	tree := filepath.Join(t.TempDir(), "src")
	if out, err := exec.Command("git", "-C", repo, "worktree", "add", "--detach", tree, rev).CombinedOutput(); err != nil {
		t.Fatalf("worktree of %s: %v: %s", rev, err, out)
	}
	defer exec.Command("git", "-C", repo, "worktree", "remove", "--force", tree).Run()
	start := time.Now()
	if out, err := exec.Command("make", "-C", tree, "build").CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v: %s", rev, err, tail(out, 3000))
	}
	t.Logf("built %s in %v", rev, time.Since(start).Round(time.Second))
	if err := os.MkdirAll(cache, 0o755); err != nil {
		t.Fatal(err)
	}
	// Renamed into place whole: a half-copied cache is never taken.
	tmp, err := os.MkdirTemp(cache, "bin-")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", "-a", filepath.Join(tree, "bin")+"/.", tmp).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if err := os.Rename(tmp, bin); err != nil {
		t.Fatal(err)
	}
	return bin
}

// pyConnLoop connects to each of argv[2:] (ADDR:PORT, each server writes 8
// bytes and closes) in turn, every 20 ms, until the file argv[1] exists;
// then prints "ok N failed M". Each failure goes to stderr with its time.
const pyConnLoop = `
import os, socket, sys, time
stop, targets = sys.argv[1], [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in sys.argv[2:]]
ok = failed = 0
while not os.path.exists(stop):
    for t in targets:
        try:
            s = socket.create_connection(t, timeout=5)
            got = b""
            while len(got) < 8:
                b = s.recv(64)
                if not b:
                    break
                got += b
            s.close()
            if got != b"12345678":
                raise Exception("got %r" % got)
            ok += 1
        except Exception as e:
            failed += 1
            print(time.strftime("%H:%M:%S"), t, e, file=sys.stderr, flush=True)
    time.sleep(0.02)
print("ok %d failed %d" % (ok, failed), flush=True)
`

// udpSeq sends numbered datagrams from src to an echo at dst every 5 ms
// until stop, and counts those whose echo never came back.
type udpSeq struct {
	sent, answered int
	err            error
	done           chan struct{}
}

func startUDPSeq(t *testing.T, l *Lab, src string, dst netip.AddrPort, stop <-chan struct{}) *udpSeq {
	u := &udpSeq{done: make(chan struct{})}
	var c net.Conn
	if err := l.Do(src, func() (err error) { c, err = net.Dial("udp4", dst.String()); return err }); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string]bool{}
	go func() {
		buf := make([]byte, 64)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			mu.Lock()
			seen[string(buf[:n])] = true
			mu.Unlock()
		}
	}()
	go func() {
		defer close(u.done)
		defer c.Close()
		for i := 0; ; i++ {
			select {
			case <-stop:
				time.Sleep(500 * time.Millisecond) // the last answers
				mu.Lock()
				u.answered = len(seen)
				mu.Unlock()
				return
			case <-time.After(5 * time.Millisecond):
			}
			if _, err := c.Write([]byte(fmt.Sprint(i))); err != nil && u.err == nil {
				u.err = err
			}
			u.sent++
		}
	}()
	return u
}

// TestUpgradeInPlace: a cluster of release v0.1.0 (its binaries built
// from the commit) in auto, upgraded to this build one host at a time as
// an operator would (stop the agent, replace the binaries, start it), with
// traffic on every layer all along: a TCP stream and short connections
// across the hosts on the preloaded programs' host sockets, short
// connections on one host (channels), containers' own TCP and UDP across
// the hosts on the cache. No connection fails and no datagram is lost;
// while the versions are mixed a container the new agent adds reaches one
// of the old host's; afterwards the new agents run every layer for every
// container, and new containers on both hosts reach the old ones.
func TestUpgradeInPlace(t *testing.T) {
	oldBin := releaseBin(t, upgradeFrom)
	newBin := labtest.BinDir(t, "skiffd")
	l := newLab(t, Config{Name: "tupgr", Hosts: 2, ContainersPerHost: 2, Mode: "auto", BinDir: oldBin})
	ctx := context.Background()
	// The version the host's running agent reports.
	version := func(host string) string {
		h, _ := l.Host(host)
		st, err := api.NewClient(h.Socket).Status(ctx)
		if err != nil || !st.Ready {
			t.Fatalf("%s: ready %v: %v", host, st.Ready, err)
		}
		return st.Version
	}
	old := version("h1")
	t.Logf("before: h1 runs %s, h2 %s", old, version("h2"))

	// Servers: h1/c1 and h2/c1 answer 8 bytes and close (preloaded: host
	// sockets), h2/c2 echoes TCP and UDP (the test's own sockets in the
	// container: the cache).
	for _, c := range []string{"h1/c1", "h2/c1"} {
		srv := startPy(t, l, c, pyChanServer, nil, "short", "7000")
		srv.line(t, 10*time.Second)
	}
	echoServer(t, l, "h2/c2", echoPort+1)
	h1c1, _ := l.IP("h1/c1")
	h2c1, _ := l.IP("h2/c1")
	h2c2, _ := l.IP("h2/c2")
	stopFile := filepath.Join(t.TempDir(), "stop")
	// Host sockets, across the hosts and on one host.
	loop := startPy(t, l, "h1/c2", pyConnLoop, nil, stopFile, fmt.Sprintf("%s:7000", h2c1), fmt.Sprintf("%s:7000", h1c1))
	stream := startStream(t, l, "h1/c2", "h2/c2", 7100) // the test's sockets: the cache
	stop := make(chan struct{})
	var stopOnce sync.Once
	end := func() { stopOnce.Do(func() { close(stop) }) }
	t.Cleanup(end) // a test that stops early stops its traffic too
	udp := startUDPSeq(t, l, "h1/c1", netip.AddrPortFrom(h2c2, echoPort+1), stop)
	type result struct {
		ok, failed int
		errs       []string // the first few failures, with their times
	}
	tcp := make(chan result, 1)
	go func() {
		var r result
		to := netip.AddrPortFrom(h2c2, echoPort+1)
		for {
			select {
			case <-stop:
				tcp <- r
				return
			case <-time.After(20 * time.Millisecond):
			}
			if err := l.Do("h1/c1", func() error { return echoOnce(to) }); err != nil {
				r.failed++
				if len(r.errs) < 5 {
					r.errs = append(r.errs, time.Now().Format("15:04:05.000")+": "+err.Error())
				}
			} else {
				r.ok++
			}
		}
	}()
	if err := stream.progresses(3 * time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)

	for i, host := range []string{"h1", "h2"} {
		if err := l.StopAgent(ctx, host); err != nil {
			t.Fatal(err)
		}
		l.Config.BinDir = newBin // the binaries replaced
		if err := l.StartAgent(ctx, host); err != nil {
			t.Fatalf("the new agent on %s: %v", host, err)
		}
		if v := version(host); v == old {
			t.Fatalf("%s still runs %s", host, v)
		} else {
			t.Logf("%s upgraded: %s", host, v)
		}
		if err := stream.progresses(3 * time.Second); err != nil {
			t.Fatalf("stream after %s's upgrade: %v", host, err)
		}
		if i == 0 {
			// Mixed versions: the new agent's container reaches the old
			// host's.
			name, err := l.AddContainer(ctx, "h1")
			if err != nil {
				t.Fatalf("a container on the upgraded h1: %v", err)
			}
			if err := l.Do(name, func() error { return echoOnce(netip.AddrPortFrom(h2c2, echoPort+1)) }); err != nil {
				t.Errorf("%s (new agent) → h2/c2 (old agent): %v", name, err)
			}
		}
		time.Sleep(time.Second)
	}

	end()
	if err := os.WriteFile(stopFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	r := <-tcp
	<-udp.done
	if err := stream.finish(); err != nil {
		t.Errorf("stream: %v", err)
	}
	t.Logf("containers' own TCP: %d connections, %d failed; UDP: %d sent, %d answered; stream %d bytes",
		r.ok+r.failed, r.failed, udp.sent, udp.answered, stream.bytes())
	if r.failed > 0 || r.ok == 0 {
		t.Errorf("%d of %d connections of the containers' own sockets to %s failed: %v", r.failed, r.ok+r.failed, h2c2, r.errs)
	}
	if udp.err != nil || udp.sent == 0 || udp.answered != udp.sent {
		t.Errorf("UDP: %d of %d datagrams unanswered (%v)", udp.sent-udp.answered, udp.sent, udp.err)
	}
	if got := loop.line(t, 20*time.Second); !strings.HasPrefix(got, "ok ") || !strings.HasSuffix(got, " failed 0") {
		t.Errorf("host sockets: %s\n%s", got, loop.out.String())
	} else {
		t.Logf("host sockets: %s", got)
	}

	// After: every layer for every container, old and new.
	for _, host := range []string{"h1", "h2"} {
		eps, err := agentOf(t, l, host).Endpoints(ctx, false)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range eps {
			for _, layer := range []string{"cache", "sockets", "channels"} {
				if on, why := layerOn(&e, layer); !on {
					t.Errorf("%s: %s after the upgrade: %s off (%s)", host, e.ContainerID, layer, why)
				}
			}
		}
	}
	name, err := l.AddContainer(ctx, "h2")
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Do(name, func() error { return echoOnce(netip.AddrPortFrom(h2c2, echoPort+1)) }); err != nil {
		t.Errorf("%s → h2/c2: %v", name, err)
	}
	if out := strings.TrimSpace(runPy(t, l, name, pyChanClient, nil, "short", h1c1.String(), "7000", "20")); out != "ok" {
		t.Errorf("%s → h1/c1 (a host socket of the old release's broker): %s", name, out)
	}
}

// echoOnce sends a line to a TCP echo server at to and reads it back.
func echoOnce(to netip.AddrPort) error {
	c, err := net.DialTimeout("tcp4", to.String(), 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("upgrade\n")); err != nil {
		return err
	}
	buf := make([]byte, 8)
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != "upgrade\n" {
		return fmt.Errorf("echo %q", buf)
	}
	return nil
}
