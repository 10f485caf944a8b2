package bench

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// summary is the median, min and max of a set of samples.
type summary struct {
	Median, Min, Max float64
}

// summarize returns the statistics of values; ok is false when there are none.
// An even count takes the mean of the two middle values as the median.
func summarize(values []float64) (s summary, ok bool) {
	if len(values) == 0 {
		return summary{}, false
	}
	v := append([]float64(nil), values...)
	sort.Float64s(v)
	n := len(v)
	median := v[n/2]
	if n%2 == 0 {
		median = (v[n/2-1] + v[n/2]) / 2
	}
	return summary{Median: median, Min: v[0], Max: v[n-1]}, true
}

// ratio returns value/base, or false when base is zero (no meaningful ratio).
func ratio(value, base float64) (float64, bool) {
	if base == 0 {
		return 0, false
	}
	return value / base, true
}

// minPairs is the fewest repetitions with a sample of both a mode and host
// for which a report gives the paired ratio and its interval.
const minPairs = 5

// bootstrapRounds is how many resamples estimate the paired ratio's interval.
const bootstrapRounds = 4000

// Paired is the median of per-repetition ratios to host, with its 95 %
// interval.
type Paired struct {
	Ratio float64 `json:"ratio"`
	Low   float64 `json:"low"`
	High  float64 `json:"high"`
}

// pairedRatio compares value with base repetition by repetition (both keyed
// by repetition): the median of value/base over the repetitions both have,
// and the 2.5th and 97.5th percentiles of that median over bootstrap
// resamples of the pairs. Neighbouring cells share the machine's state, so
// the pairs cancel much of what drifts during a run. The resamples come from
// a fixed seed: a report is reproducible from its samples. ok is false with
// fewer than minPairs pairs or a zero base.
func pairedRatio(value, base map[int]float64) (p Paired, ok bool) {
	var ratios []float64
	for _, rep := range slices.Sorted(maps.Keys(value)) {
		b, both := base[rep]
		if !both {
			continue
		}
		if b == 0 {
			return Paired{}, false
		}
		ratios = append(ratios, value[rep]/b)
	}
	if len(ratios) < minPairs {
		return Paired{}, false
	}
	med, _ := summarize(ratios)
	rng := rand.New(rand.NewPCG(1, 2))
	medians := make([]float64, bootstrapRounds)
	resample := make([]float64, len(ratios))
	for i := range medians {
		for j := range resample {
			resample[j] = ratios[rng.IntN(len(ratios))]
		}
		m, _ := summarize(resample)
		medians[i] = m.Median
	}
	sort.Float64s(medians)
	return Paired{Ratio: med.Median, Low: medians[bootstrapRounds*25/1000], High: medians[bootstrapRounds*975/1000-1]}, true
}

// clockTicks is USER_HZ, the unit of /proc/stat: 100 on every Linux ABI.
const clockTicks = 100

// parseBusyTicks reads the aggregate "cpu" line of /proc/stat and returns
// its busy clock ticks: user, nice, system, irq and softirq (guest time is
// already inside user). Not idle, iowait or steal: steal is the hypervisor
// running something else while the guest waited, which on a shared VM varies
// from minute to minute.
func parseBusyTicks(data []byte) (uint64, error) {
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 || f[0] != "cpu" {
			continue
		}
		if len(f) < 9 {
			return 0, fmt.Errorf("/proc/stat: short cpu line %q", sc.Text())
		}
		var v [8]uint64
		for i := range v {
			n, err := strconv.ParseUint(f[i+1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/stat: field %d: %w", i+1, err)
			}
			v[i] = n
		}
		return v[0] + v[1] + v[2] + v[5] + v[6], nil
	}
	return 0, errors.New("/proc/stat: no aggregate cpu line")
}

// BusyTicks is the machine's busy CPU time so far, in USER_HZ ticks
// (parseBusyTicks).
func BusyTicks() (uint64, error) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, fmt.Errorf("read CPU times: %w", err)
	}
	return parseBusyTicks(data)
}

// busySeconds is the whole-machine CPU time spent busy between two readings.
func busySeconds(before, after uint64) float64 {
	if after < before {
		return 0
	}
	return float64(after-before) / clockTicks
}
