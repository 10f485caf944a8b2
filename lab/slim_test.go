package lab

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/slim"
)

// slimCommand is a container's command preloaded with libslim.so in design.
func slimCommand(t *testing.T, l *Lab, target, design string, args ...string) *exec.Cmd {
	t.Helper()
	cmd, err := l.Command(context.Background(), target, filepath.Join(l.Config.BinDir, "skiff-perf"), args...)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Env = append(cmd.Env, "SLIM_DESIGN="+design, "SLIM_STRICT=1", "LD_PRELOAD="+filepath.Join(l.Config.BinDir, "libslim.so"))
	return cmd
}

// vxlanPackets counts what host's VXLAN device sent and received.
func vxlanPackets(t *testing.T, l *Lab, host string) uint64 {
	t.Helper()
	var n uint64
	if err := l.Do(host, func() error {
		lk, err := netlink.LinkByName(overlay.VXLANName)
		if err == nil {
			s := lk.Attrs().Statistics
			n = s.TxPackets + s.RxPackets
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return n
}

type perfResult struct {
	Transactions int     `json:"transactions"`
	Errors       int     `json:"errors"`
	P50          float64 `json:"p50_us"`
}

// TestSlimDesigns: the papers' designs as skiff bench runs them. Both
// carry TCP on host sockets (request/response moves no VXLAN packet), and
// SlimFast UDP too (Slim leaves it to the overlay);
// Slim sets each connection up over the overlay first (at least the
// handshake and the address message in VXLAN), SlimFast without any
// overlay packet. A SlimFast listener shows through its router.
func TestSlimDesigns(t *testing.T) {
	l := newLab(t, Config{Name: "tslim", Hosts: 2, ContainersPerHost: 1, Mode: "overlay", SlimRouters: true})
	srv, _ := l.IP("h1/c1")
	for i, design := range []string{slim.DesignSlim, slim.DesignSlimFast} {
		t.Run(design, func(t *testing.T) {
			port := 7800 + 10*i
			startProc(t, slimCommand(t, l, "h1/c1", design, "server", "--port", fmt.Sprint(port)), false)
			listening := func() bool {
				if design == slim.DesignSlimFast { // through the router: TCP on P and P+1, UDP on P
					ls, _ := l.Listening(context.Background(), "h1/c1")
					us, _ := l.ListeningUDP(context.Background(), "h1/c1")
					return len(ls) == 2 && len(us) == 1 && us[0].Port() == uint16(port)
				}
				cmd, _ := l.Command(context.Background(), "h1/c1", "ss", "-Hltn")
				out, _ := cmd.Output()
				return strings.Contains(string(out), fmt.Sprintf(":%d ", port+1))
			}
			for deadline := time.Now().Add(5 * time.Second); !listening(); time.Sleep(50 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the server never listened")
				}
			}
			run := func(test string, extra ...string) (perfResult, uint64) {
				t.Helper()
				before := vxlanPackets(t, l, "h2")
				out, err := slimCommand(t, l, "h2/c1", design, append([]string{"client", "--host", srv.String(), "--port", fmt.Sprint(port), "--test", test}, extra...)...).Output()
				var r perfResult
				if err != nil || json.Unmarshal(out, &r) != nil || r.Errors != 0 || r.Transactions == 0 {
					var stderr []byte
					if ee, ok := err.(*exec.ExitError); ok {
						stderr = ee.Stderr
					}
					logs, _ := os.ReadFile(filepath.Join(l.hostDir("h1"), design+"-router.log"))
					t.Fatalf("%s: %v: %s %s\nh1's router:\n%s", test, err, out, stderr, logs)
				}
				return r, vxlanPackets(t, l, "h2") - before
			}
			rr, vx := run("tcp_rr", "--duration", "1")
			t.Logf("%s tcp_rr: %d transactions, %d VXLAN packets", design, rr.Transactions, vx)
			if vx > 50 {
				t.Errorf("%s tcp_rr: %d VXLAN packets for %d transactions: not on host sockets", design, vx, rr.Transactions)
			}
			u, vx := run("udp_rr", "--duration", "1")
			t.Logf("%s udp_rr: %d transactions, %d VXLAN packets", design, u.Transactions, vx)
			switch {
			case design == slim.DesignSlim && vx < uint64(u.Transactions):
				t.Errorf("slim udp_rr: %d VXLAN packets for %d transactions: Slim carries UDP on the overlay", vx, u.Transactions)
			case design == slim.DesignSlimFast && vx > 50:
				t.Errorf("slimfast udp_rr: %d VXLAN packets for %d transactions: not on host sockets", vx, u.Transactions)
			}
			c, vx := run("connect", "--count", "200")
			t.Logf("%s connect: p50 %.0f µs, %d VXLAN packets for 200 connections", design, c.P50, vx)
			switch {
			case design == slim.DesignSlim && vx < 3*200:
				t.Errorf("slim: %d VXLAN packets for 200 connections: the setup should cross the overlay", vx)
			case design == slim.DesignSlimFast && vx > 20:
				t.Errorf("slimfast: %d VXLAN packets for 200 connections: the setup should not cross the overlay", vx)
			}
		})
	}
}
