package agent

import (
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	b := backoff{min: time.Second, max: 5 * time.Second}
	var got []time.Duration
	for range 5 {
		got = append(got, b.next())
	}
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 5 * time.Second, 5 * time.Second}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("delays %v, want %v", got, want)
		}
	}
	b.reset()
	if d := b.next(); d != time.Second {
		t.Errorf("after reset: %v, want %v", d, time.Second)
	}
}

func TestQuiet(t *testing.T) {
	q := quiet{period: 30 * time.Second}
	t0 := time.Unix(1000, 0)
	for _, step := range []struct {
		msg  string
		at   time.Duration
		ok   bool
		held int
	}{
		{"a", 0, true, 0},
		{"a", time.Second, false, 0},
		{"a", 29 * time.Second, false, 0},
		{"a", 30 * time.Second, true, 2},
		{"b", 31 * time.Second, true, 0}, // a new message passes at once
		{"b", 32 * time.Second, false, 0},
		{"a", 33 * time.Second, true, 0},
	} {
		ok, held := q.pass(step.msg, t0.Add(step.at))
		if ok != step.ok || held != step.held {
			t.Fatalf("%q at %v: pass = %v, %d held; want %v, %d", step.msg, step.at, ok, held, step.ok, step.held)
		}
	}
}
