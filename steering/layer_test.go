package steering

import (
	"slices"
	"strings"
	"testing"
)

// TestOptions: defaults, and the options a layer refuses.
func TestOptions(t *testing.T) {
	l, err := newLayer(nil)
	if err != nil {
		t.Fatal(err)
	}
	o := l.(*Layer).opts
	if len(o.CPUs) == 0 || o.Threshold != DefaultThreshold || o.HeavyBytes != DefaultHeavyBytes || o.Interval == 0 {
		t.Errorf("defaults %+v", o)
	}
	if l, err := newLayer(Options{CPUs: []int{3, 1, 3}, HeavyBytes: -1}); err != nil || !slices.Equal(l.(*Layer).opts.CPUs, []int{1, 3}) || l.(*Layer).opts.HeavyBytes != -1 {
		t.Errorf("CPUs 3,1,3, every flow: %+v, %v", l, err)
	}
	for _, c := range []struct {
		o    any
		want string
	}{
		{Options{CPUs: []int{64}}, "want CPUs 0 to 63"},
		{Options{CPUs: []int{-1}}, "want CPUs 0 to 63"},
		{Options{Threshold: 101}, "want 1 to 100"},
		{Options{HeavyBytes: -2}, "want 0 to 2^30"},
		{Options{HeavyBytes: 1 << 31}, "want 0 to 2^30"},
		{Options{UDPBatch: -1}, "want 0 (no splitting)"},
		{"fast", "not string"},
	} {
		if _, err := newLayer(c.o); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("options %+v: %v, want %q", c.o, err, c.want)
		}
	}
}
