package agent

import (
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/store"
)

var testCluster = cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: 1, VXLANPort: 4789}

func TestNewRejectsBadConfig(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	base := Config{Name: "h1", Underlay: "lo", EtcdEndpoints: []string{"http://127.0.0.1:1"}, EtcdTLS: store.TLS{Insecure: true}, Cluster: testCluster}
	cases := []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"no name", func(c *Config) { c.Name = "" }, "host name is empty"},
		{"unknown mode", func(c *Config) { c.Mode = "warp" }, `mode "warp" is not one of`},
		{"sockets without a broker", func(c *Config) {
			c.Mode, c.Broker = "sockets", filepath.Join(t.TempDir(), "skiff-broker")
		}, "sockets mode needs the socket broker"},
		{"bad CIDR", func(c *Config) { c.Cluster.CIDR = netip.MustParsePrefix("10.244.1.0/16") }, "cluster CIDR"},
		{"CIDR overlaps the underlay", func(c *Config) { c.Cluster.CIDR = netip.MustParsePrefix("127.0.0.0/16") }, "overlaps the underlay"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := base
			c.edit(&cfg)
			_, err := New(cfg, log)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to contain %q", err, c.want)
			}
		})
	}
	broker := filepath.Join(t.TempDir(), "skiff-broker")
	if err := os.WriteFile(broker, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := base
	cfg.Mode, cfg.Broker = "sockets", broker
	if _, err := New(cfg, log); err != nil {
		t.Fatalf("valid sockets config: %v", err)
	}
}
