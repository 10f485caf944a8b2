package cni_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cni"
	"github.com/skiffnet/skiff/lab"
	"github.com/skiffnet/skiff/lab/labtest"
)

type cniError struct {
	CNIVersion string `json:"cniVersion"`
	Code       int    `json:"code"`
	Msg        string `json:"msg"`
	Details    string `json:"details"`
}

// plugin runs the real skiff-cni binary the way a runtime does and decodes
// the CNI error object it prints on failure.
// Variables in env replace the defaults.
func plugin(t *testing.T, command, conf string, env ...string) (stdout string, cerr *cniError) {
	t.Helper()
	cmd := exec.Command(filepath.Join(labtest.BinDir(t, "skiff-cni"), "skiff-cni"))
	vars := map[string]string{"CNI_COMMAND": command, "CNI_CONTAINERID": "test-ctr", "CNI_NETNS": "/run/netns/skiff-none",
		"CNI_IFNAME": "eth0", "CNI_PATH": "/opt/cni/bin"}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		vars[k] = v
	}
	for k, v := range vars {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	cmd.Stdin = strings.NewReader(conf)
	var out bytes.Buffer
	cmd.Stdout = &out
	err := cmd.Run()
	if err == nil {
		return out.String(), nil
	}
	cerr = &cniError{}
	if jerr := json.Unmarshal(out.Bytes(), cerr); jerr != nil {
		t.Fatalf("%s failed (%v) without a CNI error object: %q", command, err, out.String())
	}
	return out.String(), cerr
}

func TestBadConfig(t *testing.T) {
	for _, tc := range []struct {
		name, conf string
		code       int
		mentions   string
	}{
		{"malformed JSON", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni",`, 6, ""},
		{"unknown field", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","sockett":"/x"}`, 7, "sockett"},
		{"wrong type", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","socket":5}`, 7, "socket"},
		{"ipam section", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","ipam":{"type":"host-local"}}`, 7, `remove the "ipam" section`},
		{"ipam section with keys", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","ipam":{"type":"host-local","subnet":"10.1.0.0/16","routes":[{"dst":"0.0.0.0/0"}]}}`, 7, `remove the "ipam" section`},
		{"ipam section without type", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","ipam":{"subnet":"10.1.0.0/16"}}`, 7, `remove the "ipam" section`},
		{"ipam not an object", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","ipam":"host-local"}`, 7, `remove the "ipam" section`},
		{"bandwidth burst without rate", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","runtimeConfig":{"bandwidth":{"egressBurst":1000}}}`, 7, "egress burst 1000 bits without a rate"},
		{"bandwidth negative", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","runtimeConfig":{"bandwidth":{"ingressRate":-1,"ingressBurst":1000}}}`, 7, "ingressRate is -1"},
		{"bandwidth absurd", `{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","runtimeConfig":{"bandwidth":{"egressRate":1e15,"egressBurst":1000}}}`, 7, "above 1tbit"},
		{"unsupported version", `{"cniVersion":"0.3.1","name":"skiff","type":"skiff-cni"}`, 1, "0.3.1"},
		{"garbage version", `{"cniVersion":"banana","name":"skiff","type":"skiff-cni"}`, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, e := plugin(t, "ADD", tc.conf)
			if e == nil {
				t.Fatal("ADD succeeded")
			}
			if tc.code != 0 && e.Code != tc.code {
				t.Errorf("code %d (%s: %s), want %d", e.Code, e.Msg, e.Details, tc.code)
			}
			if !strings.Contains(e.Msg+e.Details, tc.mentions) {
				t.Errorf("message %q / %q does not mention %q", e.Msg, e.Details, tc.mentions)
			}
		})
	}
}

func TestAgentUnreachable(t *testing.T) {
	conf := fmt.Sprintf(`{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","socket":%q}`, filepath.Join(t.TempDir(), "none.sock"))
	for _, cmd := range []string{"ADD", "DEL"} {
		_, e := plugin(t, cmd, conf)
		if e == nil || e.Code != 11 || !strings.Contains(e.Msg, "try again later") {
			t.Errorf("%s without agent: %+v, want code 11 (try again later)", cmd, e)
		}
	}
	if _, e := plugin(t, "STATUS", conf); e == nil || e.Code != 50 {
		t.Errorf("STATUS without agent: %+v, want code 50", e)
	}
}

func TestVersion(t *testing.T) {
	out, e := plugin(t, "VERSION", `{"cniVersion":"1.1.0"}`)
	if e != nil {
		t.Fatal(e)
	}
	var v struct {
		Supported []string `json:"supportedVersions"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatal(err)
	}
	if strings.Join(v.Supported, ",") != "1.0.0,1.1.0" {
		t.Errorf("supported versions %v", v.Supported)
	}
}

func TestParseConfDefaults(t *testing.T) {
	c, err := cni.ParseConf([]byte(`{"cniVersion":"1.0.0","name":"n","type":"skiff-cni","runtimeConfig":{"x":1},"args":{"cni":{}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Socket != "/run/skiff/skiffd.sock" || c.TimeoutSeconds != 60 {
		t.Errorf("defaults: %+v", c)
	}
	// An empty ipam section says nothing to ignore.
	for _, ipam := range []string{`{}`, `null`} {
		if _, err := cni.ParseConf([]byte(`{"cniVersion":"1.0.0","name":"n","type":"skiff-cni","ipam":` + ipam + `}`)); err != nil {
			t.Errorf("ipam %s: %v", ipam, err)
		}
	}
}

// TestCnitool drives ADD, CHECK and DEL through cnitool, a CNI client
// nobody here wrote, against a lab host's agent, for every spec version.
func TestCnitool(t *testing.T) {
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root and the lab")
	}
	tool, err := exec.LookPath("cnitool")
	if err != nil {
		gopath, _ := exec.Command("go", "env", "GOPATH").Output()
		tool = filepath.Join(strings.TrimSpace(string(gopath)), "bin", "cnitool")
		if _, err := os.Stat(tool); err != nil {
			t.Fatalf("cnitool not installed (make deps installs it): %v", err)
		}
	}
	ctx := context.Background()
	const name = "tcnitool"
	lab.Down(ctx, name)
	bin := labtest.BinDir(t, "skiffd", "skiff-cni")
	l, err := lab.Up(ctx, lab.Config{Name: name, Hosts: 2, ContainersPerHost: 1, BinDir: bin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lab.Down(context.Background(), name) })
	peer, _ := l.IP("h2/c1")
	for _, version := range []string{"1.0.0", "1.1.0"} {
		t.Run(version, func(t *testing.T) {
			confDir := t.TempDir()
			h1, _ := l.Host("h1")
			conf := fmt.Sprintf(`{"cniVersion":%q,"name":"skiff","plugins":[{"type":"skiff-cni","socket":%q}]}`, version, h1.Socket)
			if err := os.WriteFile(filepath.Join(confDir, "10-skiff.conflist"), []byte(conf), 0o644); err != nil {
				t.Fatal(err)
			}
			ns := "skiff-" + name + "-cnitool"
			if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
				t.Fatalf("%v: %s", err, out)
			}
			defer exec.Command("ip", "netns", "del", ns).Run()
			nsPath := lab.NetnsPath(ns)
			run := func(args ...string) string {
				cmd := exec.Command(tool, args...)
				cmd.Env = append(os.Environ(), "NETCONFPATH="+confDir, "CNI_PATH="+bin, "CNI_IFNAME=eth0")
				out, err := cmd.CombinedOutput()
				if err != nil {
					t.Fatalf("cnitool %v: %v\n%s", args, err, out)
				}
				return string(out)
			}
			out := run("add", "skiff", nsPath)
			var res struct {
				CNIVersion string `json:"cniVersion"`
				IPs        []struct {
					Address string `json:"address"`
				} `json:"ips"`
			}
			if err := json.Unmarshal([]byte(out), &res); err != nil || len(res.IPs) != 1 || res.CNIVersion != version {
				t.Fatalf("ADD result %q (%v)", out, err)
			}
			run("check", "skiff", nsPath)
			ping := exec.Command("ip", "netns", "exec", ns, "ping", "-c", "1", "-W", "2", peer.String())
			if out, err := ping.CombinedOutput(); err != nil {
				t.Errorf("cnitool-made container cannot reach %s: %v\n%s", peer, err, out)
			}
			run("del", "skiff", nsPath)
			run("del", "skiff", nsPath) // idempotent
		})
	}
}

// TestBadArgs: CNI_CONTAINERID, CNI_IFNAME and CNI_NETNS are checked as
// libcni checks them, before the agent is asked: error 4 ("invalid
// necessary environment variables"), also with no agent running (which
// would be 11, "try again later", for ever).
func TestBadArgs(t *testing.T) {
	conf := fmt.Sprintf(`{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","socket":%q}`, filepath.Join(t.TempDir(), "none.sock"))
	for _, tc := range []struct {
		name     string
		env      []string
		mentions string
	}{
		{"ID with ../", []string{"CNI_CONTAINERID=../../../tmp/skiff-escape"}, "containerid"},
		{"ID with / inside", []string{"CNI_CONTAINERID=a/../../x"}, "containerid"},
		{"ID ..", []string{"CNI_CONTAINERID=.."}, "containerid"},
		{"oversized ID", []string{"CNI_CONTAINERID=" + strings.Repeat("a", 4096)}, "morethan128"},
		{"ifname ..", []string{"CNI_IFNAME=.."}, "interfacename"},
		{"ifname with /", []string{"CNI_IFNAME=a/b"}, "interfacename"},
		{"ifname too long", []string{"CNI_IFNAME=abcdefghijklmnop"}, "interfacename"},
		{"relative netns", []string{"CNI_NETNS=run/netns/x"}, "cni_netns"},
		{"netns with ..", []string{"CNI_NETNS=/run/netns/../../etc/passwd"}, "cni_netns"},
	} {
		for _, cmd := range []string{"ADD", "DEL", "CHECK"} {
			t.Run(tc.name+"/"+cmd, func(t *testing.T) {
				_, e := plugin(t, cmd, conf, tc.env...)
				if e == nil {
					t.Fatal("succeeded")
				}
				// skel itself checks the ID's characters and the interface
				// name, in its own words
				said := strings.ToLower(strings.ReplaceAll(e.Msg+e.Details, " ", ""))
				if e.Code != 4 || !strings.Contains(said, tc.mentions) {
					t.Errorf("%+v, want code 4 mentioning %q", e, tc.mentions)
				}
			})
		}
	}
	// DEL may come without a netns: that is not an argument error.
	if _, e := plugin(t, "DEL", conf, "CNI_NETNS="); e == nil || e.Code != 11 {
		t.Errorf("DEL without netns, no agent: %+v, want code 11", e)
	}
}

// TestAgentErrorCodes: every agent failure becomes a documented code: the
// spec's, or skiff's own from 100 (README, "CNI error codes"); never 999.
func TestAgentErrorCodes(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var status int
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(status)
		json.NewEncoder(w).Encode(api.Error{Message: "the agent says no"})
	})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	conf := fmt.Sprintf(`{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","socket":%q}`, sock)
	for _, tc := range []struct {
		status int
		code   int
	}{
		{http.StatusBadRequest, 4},
		{http.StatusNotFound, 3},
		{http.StatusInsufficientStorage, int(cni.ErrAddressesExhausted)},
		{http.StatusInternalServerError, int(cni.ErrAgentFailed)},
	} {
		status = tc.status
		for _, cmd := range []string{"ADD", "CHECK", "DEL"} {
			in := conf
			if cmd == "CHECK" {
				in = fmt.Sprintf(`{"cniVersion":"1.1.0","name":"skiff","type":"skiff-cni","socket":%q,"prevResult":{"cniVersion":"1.1.0","ips":[]}}`, sock)
			}
			_, e := plugin(t, cmd, in)
			if e == nil || e.Code != tc.code {
				t.Errorf("%s, agent answers %d: %+v, want code %d", cmd, tc.status, e, tc.code)
			}
		}
	}
	if cni.ErrAddressesExhausted != 100 || cni.ErrAgentFailed != 101 || cni.ErrCheckFailed != 102 {
		t.Error("the codes README documents changed")
	}
}

// TestConflistMatchesDeploy: the configuration skiffd --cni-conf-dir
// installs is the one make install does.
func TestConflistMatchesDeploy(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "deploy", "cni", cni.ConflistName))
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != cni.Conflist {
		t.Fatalf("deploy/cni/%s differs from cni.Conflist:\n%s", cni.ConflistName, b)
	}
}
