package netlinksafe

import (
	"errors"
	"fmt"
	"testing"

	"github.com/vishvananda/netlink"
)

func TestDump(t *testing.T) {
	other := errors.New("other")
	for _, tc := range []struct {
		name        string
		interrupted int   // dumps interrupted before the last one
		last        error // the last dump's error
		want        []int
		wantErr     error
		wantCalls   int
	}{
		{"first time", 0, nil, []int{1}, nil, 1},
		{"after interruptions", 3, nil, []int{1}, nil, 4},
		{"other error at once", 0, other, nil, other, 1},
		{"interrupted every time", attempts, nil, nil, netlink.ErrDumpInterrupted, attempts},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls := 0
			out, err := Dump(func() ([]int, error) {
				calls++
				if calls <= tc.interrupted {
					return []int{0}, fmt.Errorf("dump: %w", netlink.ErrDumpInterrupted)
				}
				if tc.last != nil {
					return nil, tc.last
				}
				return []int{1}, nil
			})
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
				t.Errorf("error %v, want %v", err, tc.wantErr)
			}
			if fmt.Sprint(out) != fmt.Sprint(tc.want) {
				t.Errorf("result %v, want %v", out, tc.want)
			}
			if calls != tc.wantCalls {
				t.Errorf("%d dumps, want %d", calls, tc.wantCalls)
			}
		})
	}
}
