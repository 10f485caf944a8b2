package steering

import (
	"strings"
	"testing"
)

const statA = `cpu  100 0 100 800 0 0 0 0 0 0
cpu0 50 0 50 400 0 0 0 0 0 0
cpu1 50 0 50 400 0 0 0 0 0 0
intr 12345
`

const statB = `cpu  100 0 100 800 0 0 0 0 0 0
cpu0 150 0 50 400 0 0 0 0 0 0
cpu1 50 0 50 500 0 0 10 0 0 0
`

// TestSampler: busy is all but idle and iowait; the loads are smoothed
// Falcon's way, (4·old + new)/5, over the window.
func TestSampler(t *testing.T) {
	a, err := readStat(strings.NewReader(statA))
	if err != nil || len(a) != 2 || a[0] != (cpuTimes{busy: 100, total: 500}) {
		t.Fatalf("readStat = %v, %v", a, err)
	}
	b, _ := readStat(strings.NewReader(statB))
	s := newSampler(5)
	s.add(a)
	got := s.add(b)
	// cpu0: 100 of 100 ticks busy → 100, smoothed from 0: 20; cpu1: 10 of
	// 110 → 9.1 %, smoothed: 1.8.
	if got[0] != 20 || got[1] != 2 {
		t.Errorf("loads %v, want cpu0 20, cpu1 2", got)
	}
	if _, err := readStat(strings.NewReader("cpu0 1 2 x 4 5 6 7 8\n")); err == nil {
		t.Error("a bad line was taken")
	}
}
