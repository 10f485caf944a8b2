package cli

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/store/storetest"
)

// TestDoctor: on this machine (the one CI runs on: it runs skiff) doctor
// finds nothing missing, checks the kernel, the underlay and every layer,
// and says JSON when asked; a store it cannot reach is a failure with exit
// status 1, one it reaches is listed with its hosts.
func TestDoctor(t *testing.T) {
	code, out, stderr := run(t, "doctor", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s %s", code, out, stderr)
	}
	var fs []finding
	if err := json.Unmarshal([]byte(out), &fs); err != nil {
		t.Fatal(err)
	}
	got := map[string]finding{}
	for _, f := range fs {
		got[f.Check] = f
		if f.Result == resultFail {
			t.Errorf("failed on this machine: %+v", f)
		}
	}
	for _, c := range []string{"kernel", "kernel BTF", "conntrack", "iptables", "br_netfilter", "underlay", "underlay MTU", "layer cache", "layer sockets"} {
		if _, ok := got[c]; !ok {
			t.Errorf("no %q check in %s", c, out)
		}
	}
	_, e := storetest.New(t)
	code, out, _ = run(t, "doctor", "--etcd-endpoints", e.URL, "--etcd-cafile", e.PKI.ClientTLS("root").CAFile,
		"--etcd-certfile", e.PKI.ClientTLS("root").CertFile, "--etcd-keyfile", e.PKI.ClientTLS("root").KeyFile)
	if code != 0 || !strings.Contains(out, "store ") || !strings.Contains(out, e.URL+": 0 hosts") {
		t.Errorf("a store at hand: exit %d\n%s", code, out)
	}
	code, out, stderr = run(t, "doctor", "--etcd-endpoints", "https://127.0.0.1:1", "--etcd-insecure")
	if code != 1 || !strings.Contains(stderr, "checks failed") || !strings.Contains(out, "store") {
		t.Errorf("an unreachable store: exit %d\n%s%s", code, out, stderr)
	}
}
