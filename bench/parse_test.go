package bench

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func readTestdata(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(math.Abs(a), math.Abs(b)) }

// The iperf3 samples are real iperf3 3.12 -J output captured on loopback.
func TestParseIperf3(t *testing.T) {
	tests := []struct {
		file    string
		udp     bool
		want    iperfResult
		wantErr string
	}{
		{file: "iperf3_tcp.json", want: iperfResult{BitsPerSecond: 24834943894.415836, Bytes: 3104833642}},
		{file: "iperf3_tcp_p4.json", want: iperfResult{BitsPerSecond: 26334856809.21092, Bytes: 3292528640}},
		{file: "iperf3_udp.json", udp: true,
			want: iperfResult{BitsPerSecond: 3387464414.2437024, Bytes: 423453800, LostPercent: 3.3312026590814665}},
		{file: "iperf3_error.json", wantErr: "unable to connect to server: Connection refused"},
		{file: "iperf3_error.json", udp: true, wantErr: "unable to connect"},
		{file: "perf_malformed.txt", wantErr: "parse JSON"},
		{file: "iperf3_tcp.json", udp: true, wantErr: "lost_percent missing"},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			got, err := parseIperf3(readTestdata(t, tt.file), tt.udp)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to contain %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !near(got.BitsPerSecond, tt.want.BitsPerSecond) || !near(got.Bytes, tt.want.Bytes) || !near(got.LostPercent, tt.want.LostPercent) {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

// Without sum_received (older iperf3), UDP goodput is sum scaled by the loss.
func TestParseIperf3UDPFallback(t *testing.T) {
	doc := `{"end":{"sum":{"bytes":1000,"bits_per_second":8e9,"lost_percent":25,"sender":true}}}`
	got, err := parseIperf3([]byte(doc), true)
	if err != nil {
		t.Fatal(err)
	}
	if got.BitsPerSecond != 6e9 || got.Bytes != 750 || got.LostPercent != 25 {
		t.Fatalf("got %+v", got)
	}
}

func TestIperfStreamSample(t *testing.T) {
	w, err := findWorkload("udp_stream")
	if err != nil {
		t.Fatal(err)
	}
	s, err := w.Parse(commandResult{Stdout: readTestdata(t, "iperf3_udp.json")})
	if err != nil {
		t.Fatal(err)
	}
	if !near(s.Values["throughput"], 3.3874644142437024) || !near(s.Values["loss"], 3.3312026590814665) {
		t.Fatalf("values = %v", s.Values)
	}
	if !near(s.Work, 423453800*8/1e9) {
		t.Fatalf("work = %v Gbit", s.Work)
	}
	if _, err := w.Parse(commandResult{Stdout: readTestdata(t, "iperf3_error.json")}); err == nil {
		t.Fatal("error JSON accepted")
	}
}

func TestParsePerf(t *testing.T) {
	tests := []struct {
		file    string
		want    perfResult
		wantErr string
	}{
		{file: "perf_tcp_rr_ok.txt", want: perfResult{Test: "tcp_rr", Transactions: 412345, DurationS: 10,
			Rate: 41234.5, P50: 22.1, P99: 41.7, P999: 88.3}},
		{file: "perf_memcached_ok.txt", want: perfResult{Test: "memcached", Transactions: 1500000, DurationS: 10.001,
			Rate: 149985, P50: 310, P99: 690.5, P999: 1500}},
		{file: "perf_connect_ok.txt", want: perfResult{Test: "connect", Transactions: 10000, DurationS: 1.412,
			Rate: 7082.2, P50: 120.5, P99: 240.3, P999: 810.9}},
		{file: "perf_udp_rr_errors.txt", wantErr: "12 errors"},
		{file: "perf_malformed.txt", wantErr: "parse JSON"},
		{file: "perf_missing_keys.txt", wantErr: "lacks rate, p50_us, p99_us, p999_us"},
		{file: "wrk_ok.txt", wantErr: "no JSON line"},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			got, err := parsePerf(readTestdata(t, tt.file))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to contain %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestParsePerfSampleExitCodes(t *testing.T) {
	ok := readTestdata(t, "perf_tcp_rr_ok.txt")
	tests := []struct {
		name    string
		res     commandResult
		wantErr string
	}{
		{"ok", commandResult{Stdout: ok}, ""},
		{"warning line before JSON", commandResult{Stdout: append([]byte("warming up\n"), ok...)}, ""},
		{"errors exit 2", commandResult{Stdout: readTestdata(t, "perf_udp_rr_errors.txt"), ExitCode: 2}, "12 errors"},
		{"exit 2 without errors", commandResult{Stdout: ok, ExitCode: 2}, "reported failure"},
		{"cannot connect", commandResult{ExitCode: 1, Stderr: "connect: Connection refused\n"}, "cannot connect (exit status 1): connect: Connection refused"},
		{"usage", commandResult{ExitCode: 64, Stderr: "unknown test\n"}, "usage error"},
		{"signal", commandResult{ExitCode: -1}, "skiff-perf failed"},
		{"no transactions", commandResult{Stdout: []byte(`{"test":"tcp_rr","transactions":0,"errors":0,"duration_s":1,"rate":0,"p50_us":0,"p99_us":0,"p999_us":0}`)}, "no transaction"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := parsePerfSample(tt.res)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				if s.Values["rate"] != 41234.5 || s.Values["p99"] != 41.7 || s.Work != 412345 {
					t.Fatalf("sample = %+v", s)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want it to contain %q", err, tt.wantErr)
			}
		})
	}
}

// The wrk samples are real wrk 4.1.0 output captured against nginx (and a
// broken server for socket errors) on loopback.
func TestParseWrk(t *testing.T) {
	tests := []struct {
		file    string
		want    wrkResult
		wantErr string
	}{
		{file: "wrk_ok.txt", want: wrkResult{Requests: 127765, RequestsSec: 63802.75, P50: 1450, P99: 10640}},
		{file: "wrk_close.txt", want: wrkResult{Requests: 42679, RequestsSec: 21161.69, P50: 3730, P99: 8320}},
		{file: "wrk_non2xx.txt", wantErr: "80192 non-2xx/3xx responses"},
		{file: "wrk_socket_errors.txt", wantErr: "97885 socket errors"},
		{file: "wrk_zero_requests.txt", wantErr: "no request completed"},
		{file: "perf_tcp_rr_ok.txt", wantErr: "lacks"},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			got, err := parseWrk(readTestdata(t, tt.file))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to contain %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !near(got.Requests, tt.want.Requests) || !near(got.RequestsSec, tt.want.RequestsSec) ||
				!near(got.P50, tt.want.P50) || !near(got.P99, tt.want.P99) || got.Non2xx != 0 || got.SocketErrors != 0 {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestParseWrkDuration(t *testing.T) {
	tests := map[string]float64{"812.00us": 812, "3.73ms": 3730, "1.20s": 1.2e6, "2.00m": 120e6, "1.00h": 3600e6}
	for in, want := range tests {
		got, err := parseWrkDuration(in)
		if err != nil || !near(got, want) {
			t.Errorf("parseWrkDuration(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	if _, err := parseWrkDuration("3.73xs"); err == nil {
		t.Error("bad unit accepted")
	}
}

func TestNginxWorkloadCommands(t *testing.T) {
	w, err := findWorkload("nginx_crr")
	if err != nil {
		t.Fatal(err)
	}
	env := testEnv()
	spec, err := w.Server(env)
	if err != nil {
		t.Fatal(err)
	}
	defer spec.Cleanup()
	dir := filepath.Dir(spec.Argv[len(spec.Argv)-1])
	conf, err := os.ReadFile(filepath.Join(dir, "nginx.conf"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"daemon off;", "listen 10.0.0.1:25300;", "access_log off;", "pid " + dir + "/nginx.pid;"} {
		if !strings.Contains(string(conf), want) {
			t.Errorf("nginx.conf lacks %q:\n%s", want, conf)
		}
	}
	page, err := os.ReadFile(filepath.Join(dir, "www", "index.html"))
	if err != nil || len(page) != 1024 {
		t.Errorf("index.html: %d bytes, %v; want 1024", len(page), err)
	}
	client := w.Client(env)
	run := strings.Join(client.Run, " ")
	if !strings.Contains(run, "--latency -H Connection: close http://10.0.0.1:25300/index.html") || client.Warmup == nil {
		t.Errorf("client = %q, warm-up %q", run, client.Warmup)
	}
	spec.Cleanup()
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("cleanup left %s", dir)
	}
}
