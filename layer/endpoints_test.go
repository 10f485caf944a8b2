package layer

import (
	"errors"
	"io"
	"log/slog"
	"testing"

	"github.com/skiffnet/skiff/cluster"
)

// TestAttached: the first Sync attaches every container, later ones only
// those that failed; a failure is the container's (reported by Err, logged
// once per reason) and containers that left are forgotten.
func TestAttached(t *testing.T) {
	var a Attached
	a1, a2 := cluster.Endpoint{ContainerID: "a1"}, cluster.Endpoint{ContainerID: "a2"}
	if err := a.Err(a1); err == nil || err.Error() != "not attached yet" {
		t.Errorf("before any attempt: %v", err)
	}
	broken := errors.New("cgroup x is not a cgroup v2 directory")
	var calls []string
	attach := func(e cluster.Endpoint) error {
		calls = append(calls, e.ContainerID)
		if e.ContainerID == "a2" {
			return broken
		}
		return nil
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	a.Sync([]cluster.Endpoint{a1, a2}, attach, log)
	a.Sync([]cluster.Endpoint{a1, a2}, attach, log)
	if want := []string{"a1", "a2", "a2"}; len(calls) != 3 || calls[0] != want[0] || calls[2] != want[2] {
		t.Errorf("attached %v, want %v (the failed one again)", calls, want)
	}
	if a.Err(a1) != nil || a.Err(a2) != broken {
		t.Errorf("a1: %v, a2: %v", a.Err(a1), a.Err(a2))
	}
	if err := a.Add(a2, func(cluster.Endpoint) error { return nil }); err != nil || a.Err(a2) != nil {
		t.Errorf("a2 attached later: %v, %v", err, a.Err(a2))
	}
	a.Sync([]cluster.Endpoint{a2}, attach, log)
	if a.Err(a1) == nil {
		t.Error("a1 left but is still known")
	}
	a.Remove(a2)
	if a.Err(a2) == nil {
		t.Error("a2 removed but is still known")
	}
}

// TestAttachedRecordChanged: a container whose record changed (skiff limit
// set a rate) is attached again; an unchanged one is not.
func TestAttachedRecordChanged(t *testing.T) {
	var a Attached
	calls := 0
	attach := func(cluster.Endpoint) error { calls++; return nil }
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	e := cluster.Endpoint{ContainerID: "a1"}
	a.Sync([]cluster.Endpoint{e}, attach, log)
	a.Sync([]cluster.Endpoint{e}, attach, log)
	if calls != 1 {
		t.Fatalf("attached %d times, want once", calls)
	}
	e.Limit.EgressRate, e.Limit.EgressBurst = 10e6, 1e6
	a.Sync([]cluster.Endpoint{e}, attach, log)
	if calls != 2 {
		t.Errorf("attached %d times after the limit changed, want 2", calls)
	}
}
