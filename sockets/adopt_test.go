package sockets

import (
	"testing"

	"github.com/skiffnet/skiff/sockets/broker/seccomp"
)

// TestPodSandbox: a CRI container's hand-off names its pod's sandbox, the
// sandbox's its own ID; any other runtime's names no pod.
func TestPodSandbox(t *testing.T) {
	state := func(id string, ann map[string]string) seccomp.State {
		var st seccomp.State
		st.State.ID, st.State.Annotations = id, ann
		return st
	}
	for _, c := range []struct {
		name string
		st   seccomp.State
		want string
	}{
		{"CRI container", state("c1", map[string]string{criContainerType: "container", criSandboxID: "s1"}), "s1"},
		{"CRI sandbox", state("s1", map[string]string{criContainerType: "sandbox", criSandboxID: "s1"}), "s1"},
		{"CRI container without its sandbox", state("c1", map[string]string{criContainerType: "container"}), ""},
		{"podman", state("p1", map[string]string{"io.podman.annotations.autoremove": "TRUE"}), ""},
		{"no annotations", state("x", nil), ""},
		{"unknown type", state("x", map[string]string{criContainerType: "init", criSandboxID: "s1"}), ""},
	} {
		if got := podSandbox(c.st); got != c.want {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
}
