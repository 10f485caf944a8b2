package seccomp

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestBuildNone(t *testing.T) {
	base, err := LoadBase("none")
	if err != nil {
		t.Fatal(err)
	}
	p, err := Build(base, DefaultListener)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := json.Marshal(p)
	s := string(data)
	for _, want := range []string{`"listenerPath":"/run/skiff/seccomp.sock"`, `"listenerMetadata":"skiff/v1"`,
		`"defaultAction":"SCMP_ACT_ALLOW"`, `"action":"SCMP_ACT_NOTIFY"`, `"op":"SCMP_CMP_LE","value":2147483647`,
		`"index":2,"op":"SCMP_CMP_EQ","value":16`, `"architectures":["` + nativeArch().scmp + `"]`} {
		if !strings.Contains(s, want) {
			t.Errorf("profile lacks %s:\n%s", want, s)
		}
	}
	q, err := Build(base, "")
	if err != nil {
		t.Fatal(err)
	}
	data, _ = json.Marshal(q)
	if strings.Contains(string(data), "NOTIFY") || strings.Contains(string(data), "listenerPath") {
		t.Errorf("listener \"\" still notifies: %s", data)
	}
}

func writeBase(t *testing.T, s string) string {
	path := filepath.Join(t.TempDir(), "base.json")
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestBuildBase(t *testing.T) {
	path := writeBase(t, `{"defaultAction":"SCMP_ACT_ERRNO","defaultErrnoRet":38,"archMap":[{"architecture":"SCMP_ARCH_X86_64"}],
		"syscalls":[{"names":["accept","connect","listen","read"],"action":"SCMP_ACT_ALLOW","includes":{}},
		{"names":["listen"],"action":"SCMP_ACT_ALLOW"},{"names":["ptrace"],"action":"SCMP_ACT_ERRNO"}]}`)
	base, err := LoadBase(path)
	if err != nil {
		t.Fatal(err)
	}
	p, err := Build(base, "/x.sock")
	if err != nil {
		t.Fatal(err)
	}
	rules := p["syscalls"].([]any)
	first := rules[0].(map[string]any)
	if got := first["names"]; len(got.([]string)) != 2 || got.([]string)[0] != "accept" || got.([]string)[1] != "read" {
		t.Errorf("connect and listen not removed from the allow list: %v", got)
	}
	if _, ok := first["includes"]; !ok {
		t.Error("the rule's other fields were lost")
	}
	if len(rules) != 2+len(Rules()) {
		t.Errorf("%d rules, want %d (a rule left empty goes)", len(rules), 2+len(Rules()))
	}
	if p["defaultErrnoRet"] != float64(38) || p["architectures"] != nil {
		t.Errorf("base fields changed: %v", p)
	}
}

func TestBuildRefuses(t *testing.T) {
	for name, s := range map[string]string{
		"listener":    `{"defaultAction":"SCMP_ACT_ALLOW","listenerPath":"/other.sock"}`,
		"conditioned": `{"defaultAction":"SCMP_ACT_ALLOW","syscalls":[{"names":["connect"],"action":"SCMP_ACT_ERRNO","args":[{"index":0,"value":1,"op":"SCMP_CMP_EQ"}]}]}`,
	} {
		base, err := LoadBase(writeBase(t, s))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Build(base, DefaultListener); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	for name, s := range map[string]string{"not json": `{`, "no default": `{"syscalls":[]}`} {
		if _, err := LoadBase(writeBase(t, s)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := LoadBase("/nonexistent/seccomp.json"); err == nil {
		t.Error("a missing base accepted")
	}
}
