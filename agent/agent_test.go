package agent

import (
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/cni"
	"github.com/skiffnet/skiff/sockets"
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
			c.Mode = "sockets"
			c.LayerOptions = map[string]any{"sockets": sockets.Options{Broker: filepath.Join(t.TempDir(), "skiff-broker")}}
		}, "the socket broker is missing"},
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
	cfg.Mode, cfg.LayerOptions = "sockets", map[string]any{"sockets": sockets.Options{Broker: broker}}
	if _, err := New(cfg, log); err != nil {
		t.Fatalf("valid sockets config: %v", err)
	}
}

// TestValidateRequest: the API refuses what libcni refuses, and IDs that
// would name files outside the state directory, before doing anything.
func TestValidateRequest(t *testing.T) {
	ok := api.AddRequest{ContainerID: "skiff-lab-h1-c1", IfName: "eth0", Netns: "/run/netns/skiff-lab-h1-c1"}
	with := func(f func(*api.AddRequest)) api.AddRequest { r := ok; f(&r); return r }
	for _, tc := range []struct {
		name string
		req  api.AddRequest
		del  bool
		ok   bool
	}{
		{"good", ok, false, true},
		{"good DEL without netns", with(func(r *api.AddRequest) { r.Netns = "" }), true, true},
		{"64 hex digits", with(func(r *api.AddRequest) { r.ContainerID = strings.Repeat("0a", 32) }), false, true},
		{"empty ID", with(func(r *api.AddRequest) { r.ContainerID = "" }), false, false},
		{"ID with ../", with(func(r *api.AddRequest) { r.ContainerID = "../../../tmp/x" }), false, false},
		{"ID with ../ on DEL", with(func(r *api.AddRequest) { r.ContainerID = "a/../../x" }), true, false},
		{"ID ..", with(func(r *api.AddRequest) { r.ContainerID = ".." }), false, false},
		{"oversized ID", with(func(r *api.AddRequest) { r.ContainerID = strings.Repeat("a", 100_000) }), false, false},
		{"ifname ..", with(func(r *api.AddRequest) { r.IfName = ".." }), false, false},
		{"ifname with /", with(func(r *api.AddRequest) { r.IfName = "a/b" }), false, false},
		{"ifname 16 bytes", with(func(r *api.AddRequest) { r.IfName = "abcdefghijklmnop" }), false, false},
		{"relative netns", with(func(r *api.AddRequest) { r.Netns = "run/netns/x" }), false, false},
		{"netns with ..", with(func(r *api.AddRequest) { r.Netns = "/run/netns/../../etc/passwd" }), false, false},
		{"ADD without netns", with(func(r *api.AddRequest) { r.Netns = "" }), false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := validate(tc.req, tc.del)
			if (err == nil) != tc.ok {
				t.Fatalf("validate = %v, want ok %v", err, tc.ok)
			}
			var re requestError
			if err != nil && !errors.As(err, &re) {
				t.Errorf("error %v is not a bad request (HTTP 400)", err)
			}
		})
	}
}

// TestInstallConflist: with a CNI configuration directory the agent writes
// skiff's configuration there (whole: a runtime never reads half of it),
// replacing a stale one; without one it writes nothing.
func TestInstallConflist(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, cni.ConflistName)
	if err := os.WriteFile(path, []byte("{stale"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := &Agent{cfg: Config{CNIConfDir: dir}, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	a.installConflist()
	if b, err := os.ReadFile(path); err != nil || string(b) != cni.Conflist {
		t.Fatalf("conflist %q, %v", b, err)
	}
	if names, _ := os.ReadDir(dir); len(names) != 1 {
		t.Fatalf("files left: %v", names)
	}
	none := &Agent{log: a.log}
	none.installConflist() // no directory: nothing, and no panic
}
