package bench

import (
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

func testEnv() cellEnv {
	return cellEnv{
		ServerIP: netip.MustParseAddr("10.0.0.1"), DialIP: netip.MustParseAddr("10.0.0.1"), Port: 25300, Duration: 10 * time.Second, Warmup: 2 * time.Second,
		ConnectCount: 10000,
		Tools: map[string]string{toolPerf: "/opt/skiff-perf", toolIperf3: "/usr/bin/iperf3", toolMemcached: "/usr/bin/memcached",
			toolNginx: "/usr/sbin/nginx", toolWrk: "/usr/bin/wrk"},
	}
}

func TestPlanCellsInterleavesModesAlternatingOrder(t *testing.T) {
	ws, err := resolveWorkloads([]string{"tcp_rr", "tcp_stream"}, false)
	if err != nil {
		t.Fatal(err)
	}
	modes := []Mode{{Name: "host"}, {Name: "overlay"}, {Name: "cache"}}
	var got []string
	for _, c := range planCells(ws, modes, 2) {
		got = append(got, c.Workload.Name+"/"+c.Mode.Name+"/"+string(rune('0'+c.Rep)))
	}
	want := []string{
		"tcp_stream/host/1", "tcp_stream/overlay/1", "tcp_stream/cache/1",
		"tcp_rr/host/1", "tcp_rr/overlay/1", "tcp_rr/cache/1",
		"tcp_stream/cache/2", "tcp_stream/overlay/2", "tcp_stream/host/2",
		"tcp_rr/cache/2", "tcp_rr/overlay/2", "tcp_rr/host/2",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("order:\n got %v\nwant %v", got, want)
	}
}

func TestWorkloadNames(t *testing.T) {
	quick := WorkloadNames(true)
	if !slices.Equal(quick, []string{"tcp_stream", "tcp_rr", "udp_rr", "tcp_crr", "connect"}) {
		t.Errorf("quick = %v", quick)
	}
	full := WorkloadNames(false)
	want := []string{"tcp_stream", "tcp_stream_4", "udp_stream", "udp_stress", "udp_stress_64", "udp_stress_8k", "tcp_rr", "udp_rr", "tcp_crr", "connect",
		"memcached", "memcached_crr", "nginx", "nginx_crr"}
	if !slices.Equal(full, want) {
		t.Errorf("full = %v", full)
	}
}

func TestResolveWorkloads(t *testing.T) {
	got, err := resolveWorkloads([]string{"connect", "tcp_rr", "connect"}, true)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Name != "tcp_rr" || got[1].Name != "connect" {
		t.Errorf("got %v, want report order tcp_rr, connect", got)
	}
	_, err = resolveWorkloads([]string{"tcp_rr", "bogus"}, false)
	if err == nil || !strings.Contains(err.Error(), `unknown workload "bogus" (valid: tcp_stream, tcp_stream_4,`) {
		t.Errorf("err = %v", err)
	}
}

func TestResolveModes(t *testing.T) {
	names := func(ms []Mode) []string {
		var out []string
		for _, m := range ms {
			out = append(out, m.Name)
		}
		return out
	}
	tests := []struct {
		name      string
		requested []string
		labMode   string
		want      []string
		wantErr   string
	}{
		{"default on overlay lab", nil, "overlay", []string{"host", "overlay"}, ""},
		{"default on other lab", nil, "steering", []string{"host"}, ""},
		{"default on a cache lab", nil, "cache", []string{"host", "cache"}, ""},
		{"default on two labs", nil, "overlay+cache", []string{"host", "cache", "overlay"}, ""},
		{"host moved first, dedup", []string{"overlay", "host", "overlay"}, "overlay", []string{"host", "overlay"}, ""},
		{"without host", []string{"overlay"}, "overlay", []string{"overlay"}, ""},
		{"default on a sockets lab: no host-sockets", nil, "sockets", []string{"host", "sockets"}, ""},
		{"host-sockets asked for", []string{"host", "sockets", "host-sockets"}, "overlay+sockets", []string{"host", "sockets", "host-sockets"}, ""},
		{"unknown", []string{"host", "warp"}, "overlay", nil, `unknown mode "warp" (valid: host, auto, auto-plain, auto-plain-rewrite, auto-seccomp, cache, cache-rewrite, channels, host-sockets, overlay, slim, slimfast, sockets, sockets-seccomp, steering)`},
		{"wrong lab", []string{"overlay"}, "cache", nil, `mode "overlay" needs a lab in "overlay" mode, but the lab is in "cache" mode`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := resolveModes(tt.requested, tt.labMode)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || !slices.Equal(names(got), tt.want) {
				t.Fatalf("got %v, %v; want %v", names(got), err, tt.want)
			}
		})
	}
}

func TestModePlacement(t *testing.T) {
	tests := []struct {
		mode     string
		sameHost bool
		want     Endpoints
	}{
		{"host", false, Endpoints{"h1", "h2"}},
		{"host", true, Endpoints{"h1", "h1"}},
		{"overlay", false, Endpoints{"h1/c1", "h2/c1"}},
		{"overlay", true, Endpoints{"h1/c1", "h1/c2"}},
		{"host-sockets", false, Endpoints{"h1", "h2"}},
	}
	for _, tt := range tests {
		if got := Modes[tt.mode].Endpoints(tt.sameHost); got != tt.want {
			t.Errorf("%s same=%v: %+v, want %+v", tt.mode, tt.sameHost, got, tt.want)
		}
	}
}

func TestSetEnv(t *testing.T) {
	cmd := exec.Command("true")
	cmd.Env = []string{"A=1", "LD_PRELOAD=/old.so", "B=2"}
	SetEnv(cmd, "LD_PRELOAD", "/new.so")
	if !slices.Equal(cmd.Env, []string{"A=1", "B=2", "LD_PRELOAD=/new.so"}) {
		t.Errorf("env = %v", cmd.Env)
	}
	fresh := exec.Command("true")
	SetEnv(fresh, "SKIFF_X", "1")
	if len(fresh.Env) == 0 || fresh.Env[len(fresh.Env)-1] != "SKIFF_X=1" {
		t.Errorf("env = %v", fresh.Env)
	}
}

func TestClientCommands(t *testing.T) {
	// Clients dial the server's front (a Service's address), servers bind
	// their own.
	env := testEnv()
	env.DialIP = netip.MustParseAddr("10.96.0.10")
	tests := map[string][2]string{ // warm-up, run
		"tcp_stream":   {"/usr/bin/iperf3 -c 10.96.0.10 -p 25300 -t 2", "/usr/bin/iperf3 -c 10.96.0.10 -p 25300 -t 10 -J"},
		"tcp_stream_4": {"/usr/bin/iperf3 -c 10.96.0.10 -p 25300 -t 2 -P 4", "/usr/bin/iperf3 -c 10.96.0.10 -p 25300 -t 10 -J -P 4"},
		"udp_stream": {"/usr/bin/iperf3 -c 10.96.0.10 -p 25300 -t 2 -u -b 0 -l 1400",
			"/usr/bin/iperf3 -c 10.96.0.10 -p 25300 -t 10 -J -u -b 0 -l 1400"},
		"tcp_rr": {"/opt/skiff-perf client --test tcp_rr --host 10.96.0.10 --port 25300 --duration 2",
			"/opt/skiff-perf client --test tcp_rr --host 10.96.0.10 --port 25300 --duration 10"},
		"udp_rr": {"/opt/skiff-perf client --test udp_rr --host 10.96.0.10 --port 25300 --duration 2",
			"/opt/skiff-perf client --test udp_rr --host 10.96.0.10 --port 25300 --duration 10"},
		"tcp_crr": {"/opt/skiff-perf client --test tcp_crr --host 10.96.0.10 --port 25300 --duration 2",
			"/opt/skiff-perf client --test tcp_crr --host 10.96.0.10 --port 25300 --duration 10"},
		"connect": {"/opt/skiff-perf client --test connect --host 10.96.0.10 --port 25300 --duration 2",
			"/opt/skiff-perf client --test connect --host 10.96.0.10 --port 25300 --count 10000"},
		"memcached": {"/opt/skiff-perf client --test memcached --host 10.96.0.10 --port 25300 --duration 2 --connections 50",
			"/opt/skiff-perf client --test memcached --host 10.96.0.10 --port 25300 --duration 10 --connections 50"},
		"memcached_crr": {"/opt/skiff-perf client --test memcached --host 10.96.0.10 --port 25300 --duration 2 --connections 50 --new-conn",
			"/opt/skiff-perf client --test memcached --host 10.96.0.10 --port 25300 --duration 10 --connections 50 --new-conn"},
		"nginx": {"/usr/bin/wrk -t2 -c100 -d 2s http://10.96.0.10:25300/index.html",
			"/usr/bin/wrk -t2 -c100 -d 10s --latency http://10.96.0.10:25300/index.html"},
	}
	for name, want := range tests {
		w, err := findWorkload(name)
		if err != nil {
			t.Fatal(err)
		}
		c := w.Client(env)
		if got := strings.Join(c.Warmup, " "); got != want[0] {
			t.Errorf("%s warm-up:\n got %s\nwant %s", name, got, want[0])
		}
		if got := strings.Join(c.Run, " "); got != want[1] {
			t.Errorf("%s client:\n got %s\nwant %s", name, got, want[1])
		}
	}
	servers := map[string]string{
		"tcp_stream": "/usr/bin/iperf3 -s -p 25300 -B 10.0.0.1 [tcp/25300]",
		"udp_rr":     "/opt/skiff-perf server --bind 10.0.0.1 --port 25300 [udp/25300]",
		"connect":    "/opt/skiff-perf server --bind 10.0.0.1 --port 25300 [tcp/25301]",
		"memcached":  "/usr/bin/memcached -u root -l 10.0.0.1 -p 25300 -U 0 -t 2 [tcp/25300]",
	}
	for name, want := range servers {
		w, _ := findWorkload(name)
		spec, err := w.Server(env)
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Join(spec.Argv, " ") + " " + formatPorts(spec.Ready); got != want {
			t.Errorf("%s server:\n got %s\nwant %s", name, got, want)
		}
	}
}

func formatPorts(ps []listenPort) string {
	var s []string
	for _, p := range ps {
		s = append(s, p.String())
	}
	return "[" + strings.Join(s, " ") + "]"
}

func TestMissingToolsListed(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	ws, _ := resolveWorkloads([]string{"tcp_stream", "udp_stream", "nginx"}, false)
	_, err := resolveTools(ws, "")
	if err == nil {
		t.Fatal("missing tools accepted")
	}
	for _, want := range []string{"iperf3 (for tcp_stream, udp_stream", "nginx (for nginx", "wrk (for nginx"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("err %q lacks %q", err, want)
		}
	}
	ws, _ = resolveWorkloads([]string{"tcp_rr"}, false)
	if _, err := resolveTools(ws, "/nonexistent/skiff-perf"); err == nil || !strings.Contains(err.Error(), "skiff-perf") {
		t.Errorf("bad PerfBin: err = %v", err)
	}
}

func TestEstimateQuickProfileFits(t *testing.T) {
	r := &runner{prof: quickProfile, duration: quickProfile.Cell, warmup: quickProfile.Warmup, connects: quickProfile.ConnectCount}
	ws, _ := resolveWorkloads(nil, true)
	var total time.Duration
	for _, c := range planCells(ws, []Mode{Modes["host"], Modes["overlay"]}, quickProfile.Repeat) {
		total += r.estimate(c)
	}
	if total <= 0 || total > 3*time.Minute {
		t.Fatalf("quick profile estimate %s, want within 3m", total)
	}
}

// TestAutoPlainRunsWithoutShim: auto-plain takes the preload a lab's
// command carries away (and only it); auto-seccomp runs under the filter.
func TestAutoPlainRunsWithoutShim(t *testing.T) {
	cmd := exec.Command("true")
	cmd.Env = []string{"A=1", "LD_PRELOAD=/x/libskiff.so", "LD_PRELOAD_X=2"}
	Modes["auto-plain"].Wrap(cmd)
	if got := strings.Join(cmd.Env, " "); got != "A=1 LD_PRELOAD_X=2" {
		t.Errorf("auto-plain environment %q", got)
	}
	if m := Modes["auto-seccomp"]; !m.Seccomp || m.LabMode != "auto" || m.Wrap != nil {
		t.Errorf("auto-seccomp: %+v", m)
	}
}

// TestSlimModesPreloadTheirShim: slim and slimfast preload the library
// the lab names, with their design and strict, in a lab of their own.
func TestSlimModesPreloadTheirShim(t *testing.T) {
	for _, d := range []string{"slim", "slimfast"} {
		cmd := exec.Command("true")
		cmd.Env = []string{"SLIM_LIB=/x/libslim.so", "SLIM_ROUTER_DIR=/run/h1"}
		m := Modes[d]
		m.Wrap(cmd)
		if got := strings.Join(cmd.Env, " "); got != "SLIM_LIB=/x/libslim.so SLIM_ROUTER_DIR=/run/h1 SLIM_DESIGN="+d+" SLIM_STRICT=1 LD_PRELOAD=/x/libslim.so" {
			t.Errorf("%s environment %q", d, got)
		}
		if !m.LabSlim || m.Lab() != "overlayslim" || m.Fits("overlay") || !m.Fits("overlay+overlayslim") {
			t.Errorf("%s: lab %s", d, m.Lab())
		}
	}
}
