package layertest_test

import (
	"bytes"
	"context"
	"flag"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/agent"
	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cli"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/layer/layertest"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

// toy is a data-plane layer as small as one can be: a flag, a counter, a
// detail, a view and a metric, all from this package, which nothing else
// names (docs/layers.md, "Adding a layer").
type toy struct{ greeting string }

type toyStatus struct {
	Greeting string `json:"greeting"`
}

func init() {
	layer.Register(layer.Registration{
		Name:   "toy",
		Manual: "a test's layer: runs only when named",
		Flags: func(fs *flag.FlagSet) layer.FlagOptions {
			greeting := fs.String("toy-greeting", "hello", "toy layer: what it says")
			return func(layer.Settings) (any, error) { return *greeting, nil }
		},
		New: func(options any) (layer.Layer, error) {
			g, _ := options.(string)
			return &toy{greeting: g}, nil
		},
		Teardown: func(layer.Env, any) (bool, error) { return false, nil },
	})
}

func (*toy) Start(context.Context, layer.Env) error                 { return nil }
func (*toy) AddEndpoint(context.Context, cluster.Endpoint) error    { return nil }
func (*toy) RemoveEndpoint(context.Context, cluster.Endpoint) error { return nil }
func (*toy) Endpoint(cluster.Endpoint) (bool, string)               { return true, "" }
func (*toy) Sync(context.Context, *layer.View) error                { return nil }
func (*toy) Settle(context.Context, *layer.View) error              { return nil }
func (*toy) Close() error                                           { return nil }
func (t *toy) Status([]cluster.Endpoint) layer.Report {
	m := layer.Metrics{Layer: "toy"}
	m.Counters("greetings_total", "Greetings said.", "greeting", map[string]uint64{t.greeting: 3})
	return layer.Report{
		Counters: map[string]uint64{"said": 3},
		Details:  toyStatus{Greeting: t.greeting},
		View:     []api.Section{{Title: "toy says " + t.greeting}},
		Metrics:  m.List(),
	}
}

// TestToyLayer: a layer registered from its own package alone gets its
// flags on skiffd, its counters and details in the status JSON, its view in
// skiff status and skiff NAME, a mode of the lab and the bench, and its
// metrics on /metrics.
func TestToyLayer(t *testing.T) {
	fs := flag.NewFlagSet("skiffd", flag.ContinueOnError)
	options := layer.DefineFlags(fs)
	if err := fs.Parse([]string{"--toy-greeting", "ahoy"}); err != nil {
		t.Fatal(err)
	}
	opts, err := options(layer.Settings{})
	if err != nil || opts["toy"] != "ahoy" {
		t.Fatalf("options %v, %v", opts, err)
	}

	e := storetest.Start(t, store.EmbeddedConfig{})
	creds, err := e.ClientTLS(store.AdminName)
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(agent.Config{Name: "h1", Underlay: "lo", EtcdEndpoints: []string{e.URL}, EtcdTLS: creds,
		Layers: []string{"toy"}, LayerOptions: opts, Cluster: cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: 1, VXLANPort: 4789}},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "skiffd.sock")
	srv, err := a.Serve(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	// The status JSON.
	st, err := api.NewClient(sock).Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	d, l, err := layer.DetailsOf[toyStatus](st, "toy")
	if err != nil || d == nil || d.Greeting != "ahoy" || l.Counters["said"] != 3 {
		t.Fatalf("status: %+v, %+v, %v", d, l, err)
	}
	// skiff status, and skiff toy.
	for _, args := range [][]string{{"status", "--socket", sock}, {"toy", "--socket", sock}} {
		var out, errOut bytes.Buffer
		if code := cli.Run(context.Background(), cli.Env{Args: args, Stdout: &out, Stderr: &errOut}); code != 0 || !strings.Contains(out.String(), "toy says ahoy") {
			t.Errorf("skiff %s: exit %d\n%s%s", strings.Join(args, " "), code, out.String(), errOut.String())
		}
	}
	// skiff bench knows it as a mode, and the lab (skiff lab up --mode).
	for _, args := range [][]string{{"bench", "--help"}, {"lab", "up", "--help"}} {
		var out bytes.Buffer
		cli.Run(context.Background(), cli.Env{Args: args, Stdout: &out, Stderr: &out})
		if !strings.Contains(out.String(), "toy") {
			t.Errorf("skiff %s does not list the toy layer:\n%s", strings.Join(args, " "), out.String())
		}
	}
	// /metrics.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addr := storetest.FreeAddrs(t, 1)[0]
	if err := a.ServeMetrics(ctx, addr); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if got := layertest.Value(t, string(body), "skiff_toy_greetings_total", map[string]string{"greeting": "ahoy"}); got != 3 {
		t.Errorf("skiff_toy_greetings_total %v", got)
	}
	if got := layertest.Value(t, string(body), "skiff_layer_on", map[string]string{"layer": "toy"}); got != 1 {
		t.Errorf("skiff_layer_on{layer=toy} %v", got)
	}
}
