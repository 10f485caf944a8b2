package scale

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/lab"
)

// FlowsPoint is Flows TCP connections open at once from a pod to a pod of
// another host.
type FlowsPoint struct {
	Flows int `json:"flows"`
	// Opened connections, in OpenSeconds; Echoed: of them, those that
	// then carried a byte there and back (a connection that did not is a
	// drop).
	Opened      int     `json:"opened"`
	OpenSeconds float64 `json:"openSeconds"`
	Echoed      int     `json:"echoed"`
	// Table is the cache's connection table on the client's host: its
	// entries with every connection open, and its size.
	Table     int `json:"table"`
	TableSize int `json:"tableSize"`
	// SYNs is what the client host's cache did with the connections'
	// first packets (its from_container counters over the opening:
	// table_open, table_full — those take the overlay —, table_no_path,
	// new_unjudged, new_tracked); NewSYNs the same for 100 connections
	// made with every connection open: do new flows still get the fast
	// path?
	SYNs    map[string]uint64 `json:"syns"`
	NewSYNs map[string]uint64 `json:"newSYNs"`
	// Conntrack is the client host's conntrack entries with every
	// connection open (the flows the overlay carries); AgentRSSMiB its
	// agent's memory.
	Conntrack   int     `json:"conntrack"`
	AgentRSSMiB float64 `json:"agentRSSMiB"`
	// Errors are the connections that could not be opened (how many, the
	// first error), by client process.
	Errors []string `json:"errors,omitempty"`
}

func runFlows(ctx context.Context, o Options) ([]FlowsPoint, error) {
	var out []FlowsPoint
	for _, n := range o.Flows {
		p, err := flows(ctx, o, n)
		if err != nil {
			return out, fmt.Errorf("%d flows: %w", n, err)
		}
		o.logf("flows %d: %d opened in %.1f s, %d echoed; table %d of %d; SYNs %v; 100 new %v; conntrack %d; agent %.0f MiB",
			n, p.Opened, p.OpenSeconds, p.Echoed, p.Table, p.TableSize, p.SYNs, p.NewSYNs, p.Conntrack, p.AgentRSSMiB)
		out = append(out, p)
	}
	return out, nil
}

// flows runs on a lab of its own for each size: a closed connection stays
// in the table for the FIN timeout, and would count in the next size.
func flows(ctx context.Context, o Options, n int) (FlowsPoint, error) {
	const name = "sflows"
	p := FlowsPoint{Flows: n}
	o.logf("flows: lab %s (2 hosts, auto), %d connections", name, n)
	l, err := up(ctx, o, name, 2, 1)
	if err != nil {
		return p, err
	}
	defer down(o, name)
	dst, err := l.IP("h2/c1")
	if err != nil {
		return p, err
	}
	var workers []*worker
	defer func() {
		for _, w := range workers {
			w.stop()
		}
	}()
	start := func(target string, args ...string) (*worker, error) {
		w, err := startWorker(ctx, l, o, target, args...)
		if err == nil {
			workers = append(workers, w)
		}
		return w, err
	}
	// a server and a client process for every perWorker connections, each
	// pair on a port of its own
	var dialers []*worker
	for i := range (n + perWorker - 1) / perWorker {
		port := 7200 + i
		srv, err := start("h2/c1", "serve", strconv.Itoa(port))
		if err != nil {
			return p, err
		}
		if line, err := srv.line(); err != nil || line != "listening" {
			return p, fmt.Errorf("server on port %d: %q %v", port, line, err)
		}
		dialers = append(dialers, nil) // started below, all at once
	}
	before, err := counters(ctx, l, "h1")
	if err != nil {
		return p, err
	}
	began := time.Now()
	for i := range dialers {
		count := min(perWorker, n-i*perWorker)
		if dialers[i], err = start("h1/c1", "dial", netip.AddrPortFrom(dst, uint16(7200+i)).String(), strconv.Itoa(count)); err != nil {
			return p, err
		}
	}
	for _, d := range dialers {
		opened, failed, err := d.opened()
		if err != nil {
			return p, err
		}
		p.Opened += opened
		if failed != "" {
			p.Errors = append(p.Errors, failed)
		}
	}
	p.OpenSeconds = time.Since(began).Seconds()
	opened, err := counters(ctx, l, "h1")
	if err != nil {
		return p, err
	}
	p.SYNs = synOutcomes(before, opened)
	if p.Table, p.TableSize, err = tableEntries(ctx, l, "h1"); err != nil {
		return p, err
	}
	// 100 more, with every connection open: the fast path or not?
	more, err := start("h1/c1", "dial", netip.AddrPortFrom(dst, 7200).String(), "100")
	if err != nil {
		return p, err
	}
	if _, failed, err := more.opened(); err != nil || failed != "" {
		return p, fmt.Errorf("100 more connections: %v %s", err, failed)
	}
	more.stop()
	after, err := counters(ctx, l, "h1")
	if err != nil {
		return p, err
	}
	p.NewSYNs = synOutcomes(opened, after)
	for _, d := range dialers {
		echoed, err := d.echo()
		if err != nil {
			return p, err
		}
		p.Echoed += echoed
	}
	if p.Conntrack, err = conntrack(l, "h1"); err != nil {
		return p, err
	}
	h, err := l.Host("h1")
	if err != nil {
		return p, err
	}
	pr, err := readProc(h.AgentPID)
	p.AgentRSSMiB = pr.rssMiB
	return p, err
}

// synOutcomes are the new-flow counters of the cache that moved from
// before to after, without their direction.
func synOutcomes(before, after map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for _, k := range []string{"table_open", "table_full", "table_no_path", "new_unjudged", "new_tracked", "new_denied"} {
		if d := after["from_container/"+k] - before["from_container/"+k]; d > 0 {
			out[k] = d
		}
	}
	return out
}

// counters are the cache's counters on host.
func counters(ctx context.Context, l *lab.Lab, host string) (map[string]uint64, error) {
	v, err := layerOf(ctx, l, host, "cache")
	return v.Counters, err
}

func layerOf(ctx context.Context, l *lab.Lab, host, name string) (api.Layer, error) {
	h, err := l.Host(host)
	if err != nil {
		return api.Layer{}, err
	}
	v, err := api.NewClient(h.Socket).Layer(ctx, name)
	if err != nil {
		return v, fmt.Errorf("%s on %s: %w", name, host, err)
	}
	return v, nil
}

// tableEntries is the cache's connection table on host: its entries and
// its size.
func tableEntries(ctx context.Context, l *lab.Lab, host string) (int, int, error) {
	v, err := layerOf(ctx, l, host, "cache")
	if err != nil {
		return 0, 0, err
	}
	var e cache.Entries
	if err := json.Unmarshal(v.Details, &e); err != nil {
		return 0, 0, fmt.Errorf("cache entries of %s: %w", host, err)
	}
	return e.Connections, int(e.ConnectionCapacity), nil
}

// conntrack is the number of conntrack entries in host's namespace.
func conntrack(l *lab.Lab, host string) (int, error) {
	n := 0
	err := l.Do(host, func() error {
		b, err := os.ReadFile("/proc/sys/net/netfilter/nf_conntrack_count")
		if err != nil {
			return err
		}
		n, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err
	})
	return n, err
}

// worker is a running skiff scale-flows process (Worker).
type worker struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Scanner
	stderr bytes.Buffer
}

// startWorker runs skiff scale-flows args in target (a lab container: its
// namespace and cgroup).
func startWorker(ctx context.Context, l *lab.Lab, o Options, target string, args ...string) (*worker, error) {
	cmd, err := l.Command(ctx, target, filepath.Join(o.BinDir, "skiff"), append([]string{"scale-flows"}, args...)...)
	if err != nil {
		return nil, err
	}
	w := &worker{cmd: cmd}
	cmd.Stderr = &w.stderr
	if w.in, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	w.out = bufio.NewScanner(out)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("scale-flows %v in %s: %w", args, target, err)
	}
	return w, nil
}

// line is the worker's next line of output.
func (w *worker) line() (string, error) {
	if w.out.Scan() {
		return w.out.Text(), nil
	}
	return "", fmt.Errorf("scale-flows %v ended: %v %s", w.cmd.Args, w.out.Err(), strings.TrimSpace(w.stderr.String()))
}

// opened reads a dialling worker's report: how many it opened, and how
// many it could not with the first error ("" when none failed).
func (w *worker) opened() (int, string, error) {
	line, err := w.line()
	if err != nil {
		return 0, "", err
	}
	f := strings.SplitN(line, " ", 4)
	if len(f) < 3 || f[0] != "opened" {
		return 0, "", fmt.Errorf("scale-flows: %q", line)
	}
	n, _ := strconv.Atoi(f[1])
	if f[2] != "0" {
		return n, f[2] + " failed: " + strings.Join(f[3:], " "), nil
	}
	return n, "", nil
}

// echo has a dialling worker send a byte on every connection: how many
// came back.
func (w *worker) echo() (int, error) {
	if _, err := io.WriteString(w.in, "echo\n"); err != nil {
		return 0, err
	}
	line, err := w.line()
	if err != nil {
		return 0, err
	}
	var n int
	if _, err := fmt.Sscanf(line, "echoed %d", &n); err != nil {
		return 0, fmt.Errorf("scale-flows: %q", line)
	}
	return n, nil
}

// stop ends the worker (its input closed), killing it after 10 s.
func (w *worker) stop() {
	w.in.Close()
	done := make(chan struct{})
	go func() { w.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		w.cmd.Process.Kill()
		<-done
	}
}
