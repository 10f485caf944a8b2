package iptables

import (
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	"github.com/vishvananda/netns"
)

// inNewNetns runs f in a new network namespace, so the host's rules are
// never touched.
func inNewNetns(t *testing.T, f func()) {
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		ns, err := netns.New()
		if err != nil {
			t.Error(err)
			return
		}
		defer ns.Close()
		f()
	}()
	<-done
}

func rules(t *testing.T, table, chain string) string {
	t.Helper()
	out, _ := exec.Command("iptables", "-t", table, "-S", chain).CombinedOutput()
	return strings.TrimSpace(string(out))
}

// TestChain: Install gives the chain exactly its rules and each jump once,
// first in its built-in chain, however often it runs and whatever the
// chain held; Remove leaves neither.
func TestChain(t *testing.T) {
	inNewNetns(t, func() {
		c := Chain{Table: "mangle", Name: "SKIFF-TEST",
			Rules: []string{"-j MARK --or-mark 0x1000", `-p tcp -m comment --comment "two words" -j RETURN`},
			Jumps: []Jump{
				{From: "FORWARD", Rule: []string{"-s", "10.244.0.0/16", "-j", "SKIFF-TEST"}},
				{From: "FORWARD", Rule: []string{"-d", "10.244.0.0/16", "-j", "SKIFF-TEST"}},
			},
		}
		for _, err := range []error{
			NewChain("mangle", "SKIFF-TEST"), Append("mangle", "SKIFF-TEST", "-j", "ACCEPT"), // a stale rule
			Append("mangle", "FORWARD", "-j", "ACCEPT"),
		} {
			if err != nil {
				t.Fatal(err)
			}
		}
		want := map[string]string{
			"SKIFF-TEST": "-N SKIFF-TEST\n-A SKIFF-TEST -j MARK --set-xmark 0x1000/0x1000\n" +
				`-A SKIFF-TEST -p tcp -m comment --comment "two words" -j RETURN`,
			"FORWARD": "-P FORWARD ACCEPT\n-A FORWARD -d 10.244.0.0/16 -j SKIFF-TEST\n" +
				"-A FORWARD -s 10.244.0.0/16 -j SKIFF-TEST\n-A FORWARD -j ACCEPT",
		}
		for i := range 2 {
			if err := c.Install(); err != nil {
				t.Fatal(err)
			}
			for chain, w := range want {
				if got := rules(t, "mangle", chain); got != w {
					t.Errorf("%s after Install #%d:\n%s\nwant\n%s", chain, i+1, got, w)
				}
			}
		}
		c.Remove()
		c.Remove()
		if got := rules(t, "mangle", "FORWARD"); got != "-P FORWARD ACCEPT\n-A FORWARD -j ACCEPT" {
			t.Errorf("FORWARD after Remove:\n%s", got)
		}
		if NewChain("mangle", "SKIFF-TEST") != nil || rules(t, "mangle", "SKIFF-TEST") != "-N SKIFF-TEST" {
			t.Error("the chain's rules survive Remove")
		}
	})
}

// TestNewChainKeepsRules: an existing chain keeps its rules; Delete removes
// every copy of a rule and is fine with none.
func TestNewChainKeepsRules(t *testing.T) {
	inNewNetns(t, func() {
		if err := NewChain("filter", "SKIFF-TEST"); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if err := Run("-A", "SKIFF-TEST", "-j", "DROP"); err != nil {
				t.Fatal(err)
			}
		}
		if err := NewChain("filter", "SKIFF-TEST"); err != nil {
			t.Fatal(err)
		}
		if got := rules(t, "filter", "SKIFF-TEST"); got != "-N SKIFF-TEST\n-A SKIFF-TEST -j DROP\n-A SKIFF-TEST -j DROP" {
			t.Errorf("after NewChain:\n%s", got)
		}
		Delete("filter", "SKIFF-TEST", "-j", "DROP")
		Delete("filter", "SKIFF-TEST", "-j", "DROP")
		if got := rules(t, "filter", "SKIFF-TEST"); got != "-N SKIFF-TEST" {
			t.Errorf("after Delete:\n%s", got)
		}
	})
}
