package steering

import (
	"slices"
	"testing"
)

// TestHashForIndex: for every index of every CPU count the programs
// support, and any flow, RPS (reciprocal_scale) maps the hash written back
// to the index; flows keep different hashes.
func TestHashForIndex(t *testing.T) {
	for n := uint32(1); n <= MaxCPUs; n++ {
		for idx := uint32(0); idx < n; idx++ {
			for _, f := range []uint32{0, 1, 0x1ffffff, 0x2000000, 0xdeadbeef, 0xffffffff} {
				if h := hashForIndex(idx, n, f); h == 0 || scale(h, n) != idx {
					t.Fatalf("n %d idx %d flow %#x: hash %#x scales to %d", n, idx, f, h, scale(h, n))
				}
			}
		}
	}
	if hashForIndex(1, 2, 5) == hashForIndex(1, 2, 6) {
		t.Error("two flows got one hash")
	}
}

// TestSecondChoiceDiffers: the two-choice rule's second CPU is never the
// first, for any flow, on two CPUs or more.
func TestSecondChoiceDiffers(t *testing.T) {
	for n := uint32(2); n <= 8; n++ {
		for f := uint32(0); f < 5000; f++ {
			if a, b := firstChoice(f*2654435761, 7, n), secondChoice(f*2654435761, 7, n); a == b || b >= n {
				t.Fatalf("n %d flow %d: first %d second %d", n, f, a, b)
			}
		}
	}
}

func TestMask(t *testing.T) {
	for _, c := range []struct {
		cpus []int
		mask string
	}{
		{[]int{0}, "1"},
		{[]int{0, 1}, "3"},
		{[]int{1, 3}, "a"},
		{[]int{0, 33}, "2,00000001"},
		{[]int{40, 63}, "80000100,00000000"},
	} {
		if got := FormatMask(c.cpus); got != c.mask {
			t.Errorf("FormatMask(%v) = %q, want %q", c.cpus, got, c.mask)
		}
		if got, err := ParseMask(c.mask + "\n"); err != nil || !slices.Equal(got, c.cpus) {
			t.Errorf("ParseMask(%q) = %v, %v; want %v", c.mask, got, err, c.cpus)
		}
	}
	if got, err := ParseMask("0"); err != nil || len(got) != 0 {
		t.Errorf("ParseMask(0) = %v, %v", got, err)
	}
	for _, bad := range []string{"", "x", "1,,2", "100000000"} {
		if _, err := ParseMask(bad); err == nil {
			t.Errorf("ParseMask(%q) took it", bad)
		}
	}
}
