package sockets

import (
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/cluster"
)

var testHost = cluster.Host{
	Name: "h1", UnderlayIP: netip.MustParseAddr("10.99.0.1"),
	Subnet: netip.MustParsePrefix("10.244.1.0/24"),
}

var testCluster = cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: 1, VXLANPort: 4789}

// loadTest loads the programs (verifier included) with maps pinned in a
// private bpffs directory, without attaching them.
func loadTest(t *testing.T) *Layer {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if err := bpffs.Mount(); err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp(bpffs.Root, "skiff-sockets-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	l, err := Load(Config{Cluster: testCluster, Host: testHost, Underlay: "lo", PinDir: dir, Secure: true,
		StateDir: t.TempDir(), Broker: filepath.Join(t.TempDir(), "skiff-broker")},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func TestLoad(t *testing.T) {
	l := loadTest(t)
	st, err := l.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if len(st) != len(Reasons) {
		t.Fatalf("%d counters, want %d", len(st), len(Reasons))
	}
}
