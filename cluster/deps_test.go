package cluster

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDependencies keeps the model free of the data path and the store:
// the model and what links it alone (the CNI plugin, the API's client)
// link neither cilium/ebpf, etcd nor Kubernetes' client libraries, and the
// data-plane packages link no store client (they get what they need from
// the agent).
func TestDependencies(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command")
	}
	for _, tc := range []struct {
		pkgs   []string
		banned []string
	}{
		{[]string{"cluster", "api", "cni", "policy", "cmd/skiff-cni"}, []string{"github.com/cilium/ebpf", "go.etcd.io/", "k8s.io/"}},
		{[]string{"overlay", "cache", "sockets", "channels", "steering", "limits", "policymap", "tc", "layer"}, []string{"go.etcd.io/", "k8s.io/"}},
	} {
		for _, p := range tc.pkgs {
			out, err := exec.Command(goBin, "list", "-deps", "github.com/skiffnet/skiff/"+p).Output()
			if err != nil {
				t.Fatalf("go list %s: %v", p, err)
			}
			for _, dep := range strings.Fields(string(out)) {
				for _, b := range tc.banned {
					if strings.HasPrefix(dep, b) {
						t.Errorf("%s links %s", p, dep)
						break
					}
				}
			}
		}
	}
}
