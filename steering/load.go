package steering

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The two-choice rule needs each CPU's load. The agent samples it as
// Falcon's kernel does (the CPU time counters, every 10 ms, smoothed
// (4·old + new)/5), from /proc/stat, over a window of 50 ms (a single
// 10 ms difference of USER_HZ ticks is 0 or 100 %), and writes it with its
// time into stx_loads; the programs do not believe a sample older than
// Options.Stale.

// cpuTimes is one CPU's counters from /proc/stat: busy and total ticks.
type cpuTimes struct{ busy, total uint64 }

// readStat parses the per-CPU lines of /proc/stat (busy: all but idle and
// iowait; steal counts as busy).
func readStat(r io.Reader) (map[int]cpuTimes, error) {
	out := map[int]cpuTimes{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 9 || !strings.HasPrefix(f[0], "cpu") || f[0] == "cpu" {
			continue
		}
		cpu, err := strconv.Atoi(f[0][3:])
		if err != nil {
			return nil, fmt.Errorf("/proc/stat line %q", sc.Text())
		}
		var t cpuTimes
		for i, s := range f[1:9] { // user nice system idle iowait irq softirq steal
			v, err := strconv.ParseUint(s, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("/proc/stat line %q: %w", sc.Text(), err)
			}
			t.total += v
			if i != 3 && i != 4 {
				t.busy += v
			}
		}
		out[cpu] = t
	}
	return out, sc.Err()
}

// sampler keeps a window of /proc/stat samples and the smoothed loads.
type sampler struct {
	window []map[int]cpuTimes // oldest first
	size   int
	load   map[int]float64
}

func newSampler(size int) *sampler { return &sampler{size: size, load: map[int]float64{}} }

// add takes a sample and returns each CPU's smoothed load in percent.
func (s *sampler) add(now map[int]cpuTimes) map[int]uint32 {
	s.window = append(s.window, now)
	if len(s.window) > s.size {
		s.window = s.window[1:]
	}
	out := map[int]uint32{}
	first := s.window[0]
	for cpu, t := range now {
		old, ok := first[cpu]
		if !ok || t.total <= old.total {
			out[cpu] = uint32(s.load[cpu] + 0.5)
			continue
		}
		pct := 100 * float64(t.busy-old.busy) / float64(t.total-old.total)
		s.load[cpu] = (4*s.load[cpu] + pct) / 5
		out[cpu] = uint32(s.load[cpu] + 0.5)
	}
	return out
}

// sample writes the CPUs' loads into stx_loads every interval until ctx
// ends.
func (l *Layer) sample(ctx context.Context, interval time.Duration) {
	s := newSampler(5)
	t := time.NewTicker(interval)
	defer t.Stop()
	warned := false
	for {
		if err := l.sampleOnce(s); err != nil && !warned {
			l.log.Warn("CPU loads not sampled: the two-choice rule waits", "err", err)
			warned = true
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (l *Layer) sampleOnce(s *sampler) error {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return err
	}
	times, err := readStat(f)
	f.Close()
	if err != nil {
		return err
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return err
	}
	v := stxStxLoad{StampNs: uint64(ts.Nano())}
	for cpu, pct := range s.add(times) {
		if cpu < MaxCPUs {
			v.Pct[cpu] = pct
		}
	}
	l.loads.Store(&v)
	return l.objs.StxLoads.Put(uint32(0), v)
}
