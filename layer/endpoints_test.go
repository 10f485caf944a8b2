package layer

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
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
	var logged bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logged, nil))
	a.Sync([]cluster.Endpoint{a1, a2}, attach, log)
	a.Sync([]cluster.Endpoint{a1, a2}, attach, log)
	if want := []string{"a1", "a2", "a2"}; !slices.Equal(calls, want) {
		t.Errorf("attached %v, want %v (the failed one again)", calls, want)
	}
	if n := strings.Count(logged.String(), "stays off the layer"); n != 1 {
		t.Errorf("the same failure logged %d times, want once:\n%s", n, logged.String())
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

// TestAttachedRecordChanged: a container whose attachment changed (skiff
// limit set a rate) is attached again; one whose record changed otherwise
// (the MAC the ADD filled in, the namespace path) is not; two interfaces
// of one container are two endpoints.
func TestAttachedRecordChanged(t *testing.T) {
	var a Attached
	var calls []string
	attach := func(e cluster.Endpoint) error { calls = append(calls, e.IfName); return nil }
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	e := cluster.Endpoint{ContainerID: "a1", IfName: "eth0", Netns: "/proc/7/fd/3"}
	net1 := cluster.Endpoint{ContainerID: "a1", IfName: "net1"}
	if err := a.Add(e, attach); err != nil { // at ADD, through the plugin's descriptor
		t.Fatal(err)
	}
	e.MAC, e.Netns, e.NetnsHidden = "02:00:00:00:00:01", "/run/netns/x", true // as stored
	a.Sync([]cluster.Endpoint{e, net1}, attach, log)
	a.Sync([]cluster.Endpoint{e, net1}, attach, log)
	if want := []string{"eth0", "net1"}; !slices.Equal(calls, want) {
		t.Fatalf("attached %v, want %v", calls, want)
	}
	e.Limit.EgressRate, e.Limit.EgressBurst = 10e6, 1e6
	a.Sync([]cluster.Endpoint{e, net1}, attach, log)
	if want := []string{"eth0", "net1", "eth0"}; !slices.Equal(calls, want) {
		t.Errorf("attached %v after eth0's limit changed, want %v", calls, want)
	}
	a.Remove(net1)
	if a.Err(e) != nil || a.Err(net1) == nil {
		t.Errorf("after removing net1: eth0 %v, net1 %v", a.Err(e), a.Err(net1))
	}
}
