// Package scale measures how skiff's cost grows with the work: a burst of
// pods on one host, the number of hosts, of policy rules and of concurrent
// flows (skiff bench --scale). Each part brings up a lab of its own in
// auto, measures, and takes it down; the report is JSON
// (docs/bench/scale.json), a Markdown table and SVG curves.
package scale

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/skiffnet/skiff/lab"
	"github.com/skiffnet/skiff/version"
)

// Schema names the JSON form of a Report.
const Schema = "skiff-scale/v1"

// Parts a run can measure, in the order it measures them.
var Parts = []string{"burst", "hosts", "rules", "flows"}

// Options is what to measure.
type Options struct {
	Parts  []string // default: all of Parts
	Bursts []int    // pods added at once on one host
	Hosts  []int    // lab sizes
	Rules  []int    // policy rules in force
	Flows  []int    // concurrent TCP flows between two containers
	// Repeat and Cell are the tcp_rr/tcp_crr runs of the rules part.
	Repeat int
	Cell   time.Duration
	// BinDir holds skiffd, skiff-cni and the rest (lab.Config.BinDir).
	BinDir   string
	Progress io.Writer
}

// Full are the sizes issue 45 asks for; Small a smoke run of every part
// (the lab test's).
var (
	Full  = Options{Bursts: []int{10, 50, 100, 200}, Hosts: []int{2, 10, 25, 50}, Rules: []int{10, 1000, 10000}, Flows: []int{1000, 10000, 100000}, Repeat: 5, Cell: 3 * time.Second}
	Small = Options{Bursts: []int{4}, Hosts: []int{2, 3}, Rules: []int{10, 100}, Flows: []int{100, 1000}, Repeat: 5, Cell: time.Second}
)

// Report is one scale run.
type Report struct {
	Schema  string       `json:"schema"`
	Commit  string       `json:"commit"`
	Date    string       `json:"date"`
	Kernel  string       `json:"kernel"`
	CPUs    int          `json:"cpus"`
	Burst   []BurstPoint `json:"burst,omitempty"`
	Hosts   []HostsPoint `json:"hosts,omitempty"`
	Rules   []RulesPoint `json:"rules,omitempty"`
	Flows   []FlowsPoint `json:"flows,omitempty"`
	Seconds float64      `json:"seconds"` // the whole run
}

// Spread is the p50, p99 and longest of some durations, in milliseconds.
type Spread struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
}

// spreadOf summarises ms (milliseconds, any order).
func spreadOf(ms []float64) Spread {
	if len(ms) == 0 {
		return Spread{}
	}
	s := slices.Sorted(slices.Values(ms))
	return Spread{N: len(s), P50: quantile(s, 0.5), P99: quantile(s, 0.99), Max: s[len(s)-1]}
}

// quantile of sorted values, by linear interpolation between ranks.
func quantile(sorted []float64, q float64) float64 {
	pos := q * float64(len(sorted)-1)
	i := int(pos)
	if i+1 >= len(sorted) {
		return sorted[len(sorted)-1]
	}
	return sorted[i] + (pos-float64(i))*(sorted[i+1]-sorted[i])
}

func millis(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func durationsMs(ds []time.Duration) []float64 {
	ms := make([]float64, len(ds))
	for i, d := range ds {
		ms[i] = millis(d)
	}
	return ms
}

// Run measures the parts opts names, each on a lab of its own.
func Run(ctx context.Context, opts Options) (*Report, error) {
	if len(opts.Parts) == 0 {
		opts.Parts = Parts
	}
	for _, p := range opts.Parts {
		if !slices.Contains(Parts, p) {
			return nil, fmt.Errorf("scale part %q: choose from %s", p, strings.Join(Parts, ", "))
		}
	}
	start := time.Now()
	r := &Report{Schema: Schema, Commit: version.Commit(), Date: start.UTC().Format(time.RFC3339), Kernel: kernel(), CPUs: runtime.NumCPU()}
	var errs []error
	for _, p := range Parts {
		if !slices.Contains(opts.Parts, p) {
			continue
		}
		var err error
		switch p {
		case "burst":
			r.Burst, err = runBurst(ctx, opts)
		case "hosts":
			r.Hosts, err = runHosts(ctx, opts)
		case "rules":
			r.Rules, err = runRules(ctx, opts)
		case "flows":
			r.Flows, err = runFlows(ctx, opts)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", p, err))
			if ctx.Err() != nil {
				break
			}
		}
	}
	r.Seconds = time.Since(start).Seconds()
	return r, errors.Join(errs...)
}

func (o Options) logf(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, "scale: "+format+"\n", args...)
	}
}

// up brings up a lab of its own for a part, taking down one of the same
// name a failed run left; the caller takes it down (down).
func up(ctx context.Context, o Options, name string, hosts, containers int) (*lab.Lab, error) {
	lab.Down(ctx, name)
	return lab.Up(ctx, lab.Config{Name: name, Hosts: hosts, ContainersPerHost: containers, Mode: "auto", BinDir: o.BinDir})
}

func down(o Options, name string) {
	if err := lab.Down(context.Background(), name); err != nil {
		o.logf("lab %s down: %v", name, err)
	}
}

// listen accepts TCP connections on port inside target (a lab container)
// and closes each at once: reaching it is what a probe asks. Close the
// listener to stop.
func listen(l *lab.Lab, target string, port int) (net.Listener, error) {
	var ln net.Listener
	err := l.Do(target, func() (err error) {
		ln, err = net.Listen("tcp4", ":"+strconv.Itoa(port))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen in %s: %w", target, err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return ln, nil
}

// reach dials to from inside a namespace (do runs its function there)
// until a connection is made or timeout passes: how long after since that
// was. A dropped SYN costs at most a dial's 100 ms.
func reach(do func(func() error) error, to netip.AddrPort, since time.Time, timeout time.Duration) (time.Duration, error) {
	var took time.Duration
	err := do(func() error {
		var last error
		for deadline := time.Now().Add(timeout); time.Now().Before(deadline); {
			c, err := netDial(to)
			if err == nil {
				took = time.Since(since)
				c.Close()
				return nil
			}
			last = err
			time.Sleep(5 * time.Millisecond)
		}
		return fmt.Errorf("%s not reached in %s: %w", to, timeout, last)
	})
	return took, err
}

// proc is what /proc says of a process: its resident memory and the CPU
// time it has used.
type proc struct {
	rssMiB float64
	cpu    time.Duration
}

func readProc(pid int) (proc, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return proc{}, err
	}
	// fields after the command (which may hold spaces) in parentheses
	f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	if len(f) < 22 {
		return proc{}, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	utime, _ := strconv.ParseUint(f[11], 10, 64)
	stime, _ := strconv.ParseUint(f[12], 10, 64)
	rssPages, _ := strconv.ParseUint(f[21], 10, 64)
	const ticks = 100 // USER_HZ
	return proc{rssMiB: float64(rssPages*uint64(os.Getpagesize())) / (1 << 20),
		cpu: time.Duration(utime+stime) * time.Second / ticks}, nil
}

func kernel() string {
	b, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}

// netDial makes one connection attempt, as a probe's.
func netDial(to netip.AddrPort) (net.Conn, error) {
	return net.DialTimeout("tcp4", to.String(), 100*time.Millisecond)
}
