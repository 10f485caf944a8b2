package overlay

import (
	"io"
	"log/slog"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/cluster"
)

// TestSyncLimits: a changed limit is applied in place; an unchanged one
// is left alone between repairs; a qdisc removed from under skiff comes
// back at the next repair; a lifted limit takes skiff's qdiscs away.
func TestSyncLimits(t *testing.T) {
	inTestNetns(t, func() {
		const ctr = "skiff-test-limits-ctr"
		exec.Command("ip", "netns", "del", ctr).Run()
		if out, err := exec.Command("ip", "netns", "add", ctr).CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ctr).Run() })
		o, err := New(Config{Cluster: testCluster, Host: host("h1", "192.0.2.1", "10.244.1.0/24"), Underlay: "ul0", PinDir: bpffstest.Dir(t)},
			slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		if err := o.Setup(); err != nil {
			t.Fatal(err)
		}
		e := cluster.Endpoint{ContainerID: "c1", IfName: "eth0", Host: "h1", IP: netip.MustParsePrefix("10.244.1.5/24"),
			Veth: VethName("c1", "eth0"), Netns: "/run/netns/" + ctr, Limit: cluster.Limit{EgressRate: 50e6, EgressBurst: 1e6}}
		if err := o.SyncSources([]cluster.Endpoint{e}); err != nil {
			t.Fatal(err)
		}
		if _, err := o.AddEndpoint(e); err != nil {
			t.Fatal(err)
		}
		egress := func() string {
			out, _ := exec.Command("ip", "netns", "exec", ctr, "tc", "class", "show", "dev", "eth0").CombinedOutput()
			return string(out)
		}
		sync := func() { o.SyncLimits([]cluster.Endpoint{e}) }
		sync()
		e.Limit.EgressRate = 20e6
		sync()
		if !strings.Contains(egress(), "rate 20Mbit") {
			t.Fatalf("changed limit not applied:\n%s", egress())
		}
		// Removed from under skiff: left alone until the next repair.
		if out, err := exec.Command("ip", "netns", "exec", ctr, "tc", "qdisc", "del", "dev", "eth0", "root").CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		sync()
		if strings.Contains(egress(), "rate") {
			t.Errorf("an unchanged limit was checked between repairs:\n%s", egress())
		}
		o.repaired = time.Now().Add(-repairEvery)
		sync()
		if !strings.Contains(egress(), "rate 20Mbit") {
			t.Errorf("the removed qdisc is not back after a repair:\n%s", egress())
		}
		e.Limit = cluster.Limit{}
		sync()
		if strings.Contains(egress(), "rate") {
			t.Errorf("a lifted limit left its class:\n%s", egress())
		}
		if h, _ := netlink.LinkByName(e.Veth); h == nil {
			t.Error("the host veth is gone")
		}
	})
}
