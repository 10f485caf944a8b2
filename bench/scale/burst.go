package scale

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/skiffnet/skiff/bench"
	"github.com/skiffnet/skiff/lab"
)

// BurstPoint is N pods attached at once on one host, then removed at once.
type BurstPoint struct {
	N int `json:"n"`
	// Add is each ADD as the runtime sees it (libcni: plugin start, the
	// agent, the chained plugins); Reach from the burst's start until the
	// pod connected to a pod of the other host; Del each DEL.
	Add   Spread `json:"add"`
	Reach Spread `json:"reach"`
	Del   Spread `json:"del"`
	// ReachAfterAdd is from each ADD's return until its pod connected.
	ReachAfterAdd Spread `json:"reachAfterAdd"`
	// CPUMs is the machine's CPU time (every core) from the burst's start
	// until every pod connected, per pod; AgentCPUMs the host's agent's
	// part of it. On C cores, N pods' ADDs take at least N × CPUMs / C.
	CPUMs      float64 `json:"cpuMsPerPod"`
	AgentCPUMs float64 `json:"agentCPUMsPerPod"`
	// Agent is the agent's own account of each ADD and DEL (its log):
	// "add took", "add wait" (for its locks), "add store" (the address),
	// "add overlay" (veth, addresses, routes), "add layers", "del took".
	Agent  map[string]Spread `json:"agent"`
	Failed int               `json:"failed"`
	Errors []string          `json:"errors,omitempty"`
}

const probePort = 7000

func runBurst(ctx context.Context, o Options) ([]BurstPoint, error) {
	const name = "sburst"
	o.logf("burst: lab %s (2 hosts, auto)", name)
	l, err := up(ctx, o, name, 2, 1)
	if err != nil {
		return nil, err
	}
	defer down(o, name)
	ln, err := listen(l, "h2/c1", probePort)
	if err != nil {
		return nil, err
	}
	defer ln.Close()
	dst, err := l.IP("h2/c1")
	if err != nil {
		return nil, err
	}
	var out []BurstPoint
	for _, n := range o.Bursts {
		p, err := burst(ctx, l, n, netip.AddrPortFrom(dst, probePort))
		if err != nil {
			return out, fmt.Errorf("burst of %d: %w", n, err)
		}
		o.logf("burst %d: ADD p99 %.0f ms, reach p99 %.0f ms, DEL p99 %.0f ms, %d failed", n, p.Add.P99, p.Reach.P99, p.Del.P99, p.Failed)
		out = append(out, p)
		time.Sleep(2 * time.Second) // the DELs' garbage collection
	}
	return out, nil
}

func burst(ctx context.Context, l *lab.Lab, n int, dst netip.AddrPort) (BurstPoint, error) {
	p := BurstPoint{N: n}
	logFile := l.AgentLog("h1")
	offset := fileSize(logFile)
	h, err := l.Host("h1")
	if err != nil {
		return p, err
	}
	busy, err := bench.BusyTicks()
	if err != nil {
		return p, err
	}
	agent, err := readProc(h.AgentPID)
	if err != nil {
		return p, err
	}
	var mu sync.Mutex
	var reached, after []float64
	start := time.Now()
	names, took, err := l.AddContainersThen(ctx, "h1", n, func(c lab.Container) error {
		added := time.Now()
		d, err := reach(c.Do, dst, start, 30*time.Second)
		if err == nil {
			mu.Lock()
			reached, after = append(reached, millis(d)), append(after, millis(d-added.Sub(start)))
			mu.Unlock()
		}
		return err
	})
	if err != nil {
		p.Failed = n - len(reached)
		p.Errors = append(p.Errors, err.Error())
	}
	busy2, berr := bench.BusyTicks()
	agent2, aerr := readProc(h.AgentPID)
	if berr == nil && aerr == nil {
		p.CPUMs = float64(busy2-busy) * 10 / float64(n) // USER_HZ ticks of 10 ms
		p.AgentCPUMs = millis(agent2.cpu-agent.cpu) / float64(n)
	}
	p.Add, p.Reach, p.ReachAfterAdd = spreadOf(durationsMs(took)), spreadOf(reached), spreadOf(after)
	delTook, err := l.RemoveContainers(ctx, names...)
	if err != nil {
		return p, err
	}
	p.Del = spreadOf(durationsMs(delTook))
	p.Agent = map[string]Spread{}
	for key, ms := range agentParts(logFile, offset) {
		p.Agent[key] = spreadOf(ms)
	}
	return p, nil
}

// agentParts reads the agent's log from offset: the *_ms fields of its
// "endpoint added" and "endpoint deleted" lines, as "add took",
// "del wait", ...
func agentParts(path string, offset int64) map[string][]float64 {
	parts := map[string][]float64{}
	b, err := os.ReadFile(path)
	if err != nil || int64(len(b)) < offset {
		return parts
	}
	for _, line := range strings.Split(string(b[offset:]), "\n") {
		op := ""
		switch {
		case strings.Contains(line, `msg="endpoint added"`):
			op = "add "
		case strings.Contains(line, `msg="endpoint deleted"`):
			op = "del "
		default:
			continue
		}
		for _, f := range strings.Fields(line) {
			if k, v, ok := strings.Cut(f, "="); ok && strings.HasSuffix(k, "_ms") {
				if ms, err := strconv.ParseFloat(v, 64); err == nil {
					key := op + strings.TrimSuffix(k, "_ms")
					parts[key] = append(parts[key], ms)
				}
			}
		}
	}
	return parts
}

func fileSize(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Size()
}
