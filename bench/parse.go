package bench

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// iperfResult is what the benchmark takes from one iperf3 -J run.
type iperfResult struct {
	BitsPerSecond float64 // receiver-side goodput
	Bytes         float64 // bytes received
	LostPercent   float64 // UDP only
}

type iperfSum struct {
	Bytes         *float64 `json:"bytes"`
	BitsPerSecond *float64 `json:"bits_per_second"`
	LostPercent   *float64 `json:"lost_percent"`
	Sender        *bool    `json:"sender"`
}

type iperfJSON struct {
	Error string `json:"error"`
	End   struct {
		Sum         *iperfSum `json:"sum"`
		SumReceived *iperfSum `json:"sum_received"`
	} `json:"end"`
}

// parseIperf3 reads the receiver-side result of an iperf3 3.x -J run.
// TCP: end.sum_received. UDP (iperf3 ≥ 3.12 also prints sum_received with
// only the packets that arrived): end.sum_received when present, else
// end.sum scaled by 1 - lost_percent/100. Loss comes from the receiver's
// lost_percent. iperf3 exits 0 even on failure with -J, so the "error" key
// is always checked.
func parseIperf3(out []byte, udp bool) (iperfResult, error) {
	var doc iperfJSON
	if err := json.Unmarshal(out, &doc); err != nil {
		return iperfResult{}, fmt.Errorf("iperf3: parse JSON: %w", err)
	}
	if doc.Error != "" {
		return iperfResult{}, fmt.Errorf("iperf3: %s", doc.Error)
	}
	if udp {
		return iperfUDP(doc.End.Sum, doc.End.SumReceived)
	}
	return iperfTCP(doc.End.SumReceived)
}

func iperfTCP(recv *iperfSum) (iperfResult, error) {
	if recv == nil || recv.BitsPerSecond == nil || recv.Bytes == nil {
		return iperfResult{}, errors.New("iperf3: end.sum_received missing")
	}
	return iperfResult{BitsPerSecond: *recv.BitsPerSecond, Bytes: *recv.Bytes}, nil
}

func iperfUDP(sum, recv *iperfSum) (iperfResult, error) {
	if sum == nil || sum.BitsPerSecond == nil || sum.Bytes == nil || sum.LostPercent == nil {
		return iperfResult{}, errors.New("iperf3: UDP end.sum with lost_percent missing")
	}
	loss := *sum.LostPercent
	if recv != nil && recv.LostPercent != nil {
		loss = *recv.LostPercent
	}
	if recv != nil && recv.BitsPerSecond != nil && recv.Bytes != nil && recv.Sender != nil && !*recv.Sender {
		return iperfResult{BitsPerSecond: *recv.BitsPerSecond, Bytes: *recv.Bytes, LostPercent: loss}, nil
	}
	keep := 1 - loss/100
	return iperfResult{BitsPerSecond: *sum.BitsPerSecond * keep, Bytes: *sum.Bytes * keep, LostPercent: loss}, nil
}

// perfResult is skiff-perf's one-line JSON report.
type perfResult struct {
	Test         string
	Transactions float64
	Errors       float64
	Lost         float64
	DurationS    float64
	Rate         float64
	P50, P99     float64
	P999         float64
}

type perfJSON struct {
	Test         *string  `json:"test"`
	Transactions *float64 `json:"transactions"`
	Errors       *float64 `json:"errors"`
	Lost         *float64 `json:"lost"`
	DurationS    *float64 `json:"duration_s"`
	Rate         *float64 `json:"rate"`
	P50          *float64 `json:"p50_us"`
	P99          *float64 `json:"p99_us"`
	P999         *float64 `json:"p999_us"`
}

// parsePerf decodes the JSON line skiff-perf prints on stdout (the last line
// starting with '{'). A report with errors > 0 is returned together with an error.
func parsePerf(out []byte) (perfResult, error) {
	line := lastJSONLine(out)
	if line == nil {
		return perfResult{}, errors.New("skiff-perf: no JSON line on stdout")
	}
	var doc perfJSON
	if err := json.Unmarshal(line, &doc); err != nil {
		return perfResult{}, fmt.Errorf("skiff-perf: parse JSON: %w", err)
	}
	if err := doc.checkRequired(); err != nil {
		return perfResult{}, err
	}
	r := perfResult{
		Test: *doc.Test, Transactions: *doc.Transactions, Errors: *doc.Errors,
		DurationS: *doc.DurationS, Rate: *doc.Rate, P50: *doc.P50, P99: *doc.P99, P999: *doc.P999,
	}
	if doc.Lost != nil {
		r.Lost = *doc.Lost
	}
	if r.Errors > 0 {
		return r, fmt.Errorf("skiff-perf %s: %g errors in %g transactions", r.Test, r.Errors, r.Transactions)
	}
	return r, nil
}

func (d perfJSON) checkRequired() error {
	var missing []string
	if d.Test == nil {
		missing = append(missing, "test")
	}
	for _, f := range []struct {
		name string
		v    *float64
	}{
		{"transactions", d.Transactions}, {"errors", d.Errors}, {"duration_s", d.DurationS},
		{"rate", d.Rate}, {"p50_us", d.P50}, {"p99_us", d.P99}, {"p999_us", d.P999},
	} {
		if f.v == nil {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("skiff-perf: JSON lacks %s", strings.Join(missing, ", "))
	}
	return nil
}

func lastJSONLine(out []byte) []byte {
	var last []byte
	for _, line := range bytes.Split(out, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) > 0 && line[0] == '{' {
			last = line
		}
	}
	return last
}

// wrkResult is what the benchmark takes from wrk's --latency text output.
type wrkResult struct {
	Requests     float64
	RequestsSec  float64
	P50, P99     float64 // µs
	Non2xx       float64
	SocketErrors float64 // connect + read + write + timeout
}

// parseWrk reads wrk 4.x output. A run with non-2xx/3xx responses, socket
// errors or no request at all is returned together with an error.
func parseWrk(out []byte) (wrkResult, error) {
	var r wrkResult
	var seen struct{ rate, requests, p50, p99 bool }
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		var err error
		switch {
		case strings.HasPrefix(line, "Requests/sec:"):
			r.RequestsSec, err = strconv.ParseFloat(strings.TrimSpace(strings.TrimPrefix(line, "Requests/sec:")), 64)
			seen.rate = true
		case strings.Contains(line, " requests in "):
			r.Requests, err = strconv.ParseFloat(strings.Fields(line)[0], 64)
			seen.requests = true
		case strings.HasPrefix(line, "50%"):
			r.P50, err = wrkLatencyField(line)
			seen.p50 = true
		case strings.HasPrefix(line, "99%"):
			r.P99, err = wrkLatencyField(line)
			seen.p99 = true
		case strings.HasPrefix(line, "Non-2xx or 3xx responses:"):
			r.Non2xx, err = strconv.ParseFloat(strings.TrimSpace(strings.TrimPrefix(line, "Non-2xx or 3xx responses:")), 64)
		case strings.HasPrefix(line, "Socket errors:"):
			r.SocketErrors, err = wrkSocketErrors(strings.TrimPrefix(line, "Socket errors:"))
		}
		if err != nil {
			return r, fmt.Errorf("wrk: parse %q: %w", line, err)
		}
	}
	if !seen.rate || !seen.requests || !seen.p50 || !seen.p99 {
		return r, errors.New("wrk: output lacks Requests/sec, request count or latency distribution (run with --latency)")
	}
	return r, r.check()
}

func (r wrkResult) check() error {
	switch {
	case r.Non2xx > 0:
		return fmt.Errorf("wrk: %g non-2xx/3xx responses", r.Non2xx)
	case r.SocketErrors > 0:
		return fmt.Errorf("wrk: %g socket errors", r.SocketErrors)
	case r.Requests == 0:
		return errors.New("wrk: no request completed")
	}
	return nil
}

// wrkLatencyField parses a "50%    3.73ms" line into microseconds.
func wrkLatencyField(line string) (float64, error) {
	f := strings.Fields(line)
	if len(f) != 2 {
		return 0, errors.New("want percentile and value")
	}
	return parseWrkDuration(f[1])
}

// parseWrkDuration converts wrk's "812.00us", "3.73ms", "1.20s", "2.00m" to µs.
func parseWrkDuration(s string) (float64, error) {
	units := []struct {
		suffix string
		us     float64
	}{{"us", 1}, {"ms", 1e3}, {"s", 1e6}, {"m", 60e6}, {"h", 3600e6}}
	for _, u := range units {
		if num, ok := strings.CutSuffix(s, u.suffix); ok {
			v, err := strconv.ParseFloat(num, 64)
			if err != nil {
				return 0, err
			}
			return v * u.us, nil
		}
	}
	return 0, fmt.Errorf("unknown duration %q", s)
}

// wrkSocketErrors sums " connect 0, read 10, write 97875, timeout 0".
func wrkSocketErrors(s string) (float64, error) {
	var total float64
	for _, part := range strings.Split(s, ",") {
		f := strings.Fields(part)
		if len(f) != 2 {
			return 0, fmt.Errorf("bad socket error field %q", part)
		}
		v, err := strconv.ParseFloat(f[1], 64)
		if err != nil {
			return 0, err
		}
		total += v
	}
	return total, nil
}
