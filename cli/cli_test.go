package cli

import (
	"bytes"
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/bench"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/cni"
	"github.com/skiffnet/skiff/lab"
)

func run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Run(context.Background(), Env{Args: args, Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errb,
		Getenv: func(string) string { return "" }})
	return code, out.String(), errb.String()
}

func TestCommands(t *testing.T) {
	missing := "--socket=" + filepath.Join(t.TempDir(), "none.sock")
	for _, tc := range []struct {
		args       []string
		code       int
		wantOut    string
		wantStderr string
	}{
		{[]string{}, 0, "usage: skiff", ""},
		{[]string{"version"}, 0, "skiff 0.", ""},
		{[]string{"frobnicate"}, 2, "", `unknown command "frobnicate"`},
		{[]string{"status", "--bogus"}, 2, "", "flag provided but not defined: -bogus"},
		{[]string{"policy", missing}, 2, "", "usage: skiff policy add"},
		{[]string{"policy", missing, "add", "x", "permit"}, 2, "", `action "permit"`},
		{[]string{"policy", missing, "add", "x", "deny", "port", "80"}, 2, "", "a port needs protocol tcp or udp"},
		{[]string{"policy", missing, "frob"}, 2, "", "unknown policy command"},
		{[]string{"hosts", missing}, 1, "", "skiffd is not reachable"},
		{[]string{"hosts", missing, "remove"}, 2, "", "usage: skiff hosts"},
		{[]string{"lab"}, 2, "", "usage: skiff lab"},
		{[]string{"lab", "frob"}, 2, "", "unknown lab command"},
		{[]string{"lab", "--help"}, 0, "usage: skiff lab COMMAND", ""},
		{[]string{"lab", "-h"}, 0, "  cni ", ""},
		{[]string{"lab", "help"}, 0, "usage: skiff lab COMMAND", ""},
		{[]string{"help", "lab"}, 0, "usage: skiff lab COMMAND", ""},
		{[]string{"help"}, 0, "usage: skiff", ""},
		{[]string{"--help"}, 0, "usage: skiff", ""},
		{[]string{"cert", "--help"}, 0, "usage: skiff cert", ""},
		{[]string{"cert", "help"}, 0, "usage: skiff cert", ""},
		{[]string{"policy", "help"}, 0, "", "usage: skiff policy add"},
		{[]string{"policy", "--help"}, 0, "", "usage: skiff policy add"},
		{[]string{"hosts", "help"}, 0, "", "usage: skiff hosts"},
		{[]string{"status", "help"}, 0, "", "-socket"},
		{[]string{"help", "endpoints"}, 0, "", "-all"},
		{[]string{"lab", "up", "help"}, 0, "", "-containers-per-host"},
		{[]string{"lab", "cni", "--help"}, 0, "", "usage: skiff lab cni"},
		{[]string{"lab", "cni"}, 2, "", "usage: skiff lab cni"},
		{[]string{"lab", "cni", "h1", "h2"}, 2, "", "usage: skiff lab cni"},
		{[]string{"lab", "cni", "--name", "nosuchlab", "h1"}, 1, "", `no lab named "nosuchlab" is up`},
		{[]string{"lab", "cni", "h1", "--name", "nosuchlab"}, 1, "", `no lab named "nosuchlab" is up`},
		{[]string{"lab", "ip", "h1", "--name=nosuchlab"}, 1, "", `no lab named "nosuchlab" is up`},
		{[]string{"lab", "ip", "h1", "--", "--name=nosuchlab"}, 2, "", "usage: skiff lab ip"},
		{[]string{"lab", "ip", "h1", "--bogus"}, 2, "", "flag provided but not defined: -bogus"},
		{[]string{"lab", "exec", "--name", "nosuchlab", "h1", "ip", "-x"}, 1, "", `no lab named "nosuchlab" is up`},
		{[]string{"lab", "exec", "--name", "nosuchlab", "h1", "--", "ip", "-x"}, 1, "", `no lab named "nosuchlab" is up`},
		{[]string{"hosts", "remove", missing}, 2, "", "usage: skiff hosts"},
		{[]string{"policy", "add", "x", "deny", missing}, 2, "", `"--socket=`}, // a rule's words, not a flag
		{[]string{"lab", "ip", "--name", "nosuchlab", "h1"}, 1, "", `no lab named "nosuchlab" is up`},
		{[]string{"lab", "exec", "h1"}, 2, "", "usage: skiff lab exec"},
		{[]string{"lab", "up", "--name", "Bad_Name"}, 1, "", "lab name"},
		{[]string{"lab", "up", "--hosts", "0", "--name", "x", "extra"}, 2, "", "unexpected argument"},
		{[]string{"lab", "down", "--name", "../etc"}, 1, "", "not valid"},
		{[]string{"lab", "up", "--name", "tnope", "--mode", "nope"}, 1, "", "choose one of auto, overlay, cache, channels, sockets, steering"},
		{[]string{"lab", "up", "--name", "tnope", "--cluster-cidr", "10.99.0.0/16"}, 1, "", "overlaps the lab's underlay"},
		{[]string{"lab", "up", "--name", "tnope", "--cluster-cidr", "banana"}, 1, "", "cluster CIDR"},
		{[]string{"lab", "up", "--name", "tnope", "--etcd-members", "2"}, 1, "", "2 etcd members: choose 1, 3, 5 or 7"},
		{[]string{"lab", "up", "--name", "tnope", "--etcd-members", "9"}, 1, "", "9 etcd members: choose 1, 3, 5 or 7"},
		{[]string{"lab", "up", "--name", "tnope", "--etcd-members", "three"}, 2, "", "invalid value"},
		{[]string{"bench", "--scale", "--quick"}, 2, "", "--scale brings up labs of its own"},
		{[]string{"bench", "--scale-small"}, 2, "", "go with --scale"},
		{[]string{"bench", "--scale", "--scale-parts", "planets"}, 1, "", `scale part "planets"`},
		{[]string{"scale-flows", "orbit"}, 1, "", "want serve PORT or dial ADDR:PORT N"},
		{[]string{"scale-flows", "dial", "10.0.0.1:80", "none"}, 1, "", `count "none"`},
	} {
		code, out, errOut := run(t, tc.args...)
		if code != tc.code || !strings.Contains(out, tc.wantOut) || !strings.Contains(errOut, tc.wantStderr) {
			t.Errorf("skiff %v: code %d, stdout %q, stderr %q; want code %d, stdout ~%q, stderr ~%q",
				tc.args, code, out, errOut, tc.code, tc.wantOut, tc.wantStderr)
		}
	}
}

// TestLabModesFor: labs in the order of the modes, host in the first; a
// mode on a lab's hosts (host-sockets) never shares the first lab with host.
func TestLabModesFor(t *testing.T) {
	tests := []struct {
		modes []string
		want  []string
	}{
		{[]string{"host"}, []string{"overlay"}},
		{[]string{"host", "sockets"}, []string{"sockets"}},
		{[]string{"host", "cache", "overlay"}, []string{"cache", "overlay"}},
		{[]string{"host", "host-sockets", "sockets"}, []string{"overlay", "sockets"}},
		{[]string{"host", "sockets", "overlay", "host-sockets"}, []string{"overlay", "sockets"}},
		{[]string{"host", "cache", "host-sockets"}, []string{"cache", "sockets"}},
		// A variant of a lab mode (other skiffd flags) is a lab of its own.
		{[]string{"host", "cache", "cache-rewrite", "auto-plain-rewrite"}, []string{"cache", "cacherw", "autorw"}},
		{[]string{"host", "overlay", "slim", "slimfast"}, []string{"overlay", "overlayslim"}},
	}
	for _, tt := range tests {
		if got, err := labModesFor(tt.modes); err != nil || !slices.Equal(got, tt.want) {
			t.Errorf("labModesFor(%v) = %v, %v; want %v", tt.modes, got, err, tt.want)
		}
	}
	if c := labOf("cacherw"); c.Mode != "cache" || !slices.Equal(c.AgentArgs, []string{"--cache-tunnel", "rewrite"}) {
		t.Errorf("lab cacherw: mode %s, flags %v", c.Mode, c.AgentArgs)
	}
	if c := labOf("overlayslim"); c.Mode != "overlay" || !c.SlimRouters {
		t.Errorf("lab overlayslim: %+v", c)
	}
	// Every lab gets a name of its own.
	names := map[string]string{}
	for _, m := range bench.Modes {
		if m.LabMode == "" {
			continue
		}
		n := benchLabName(m.Lab())
		if other, ok := names[n]; ok && other != m.Lab() || len(n) > 8 {
			t.Errorf("labs %s and %s both named %s", other, m.Lab(), n)
		}
		names[n] = m.Lab()
	}
	if _, err := labModesFor([]string{"host", "warp"}); err == nil || !strings.Contains(err.Error(), `unknown mode "warp"`) {
		t.Errorf("unknown mode: err = %v", err)
	}
}

// TestPrintView: a layer's view prints as titles, lines and tables.
func TestPrintView(t *testing.T) {
	var out bytes.Buffer
	err := printView(&out, []api.Section{
		{Lines: []string{"fast-path policy: 3 TCP rules, judged at connect"}},
		{Title: "sockets layer (events):", Header: []string{"COUNTER", "COUNT"}, Rows: [][]string{{"connect_fast", "7"}}},
	})
	want := "fast-path policy: 3 TCP rules, judged at connect\nsockets layer (events):\n  COUNTER       COUNT\n  connect_fast  7\n"
	if err != nil || out.String() != want {
		t.Fatalf("%v:\n%q\nwant\n%q", err, out.String(), want)
	}
}

// TestPrintConfList: skiff lab cni prints a conflist libcni reads, whose
// plugin is skiff-cni on the host's socket, in a configuration skiff-cni
// accepts.
func TestPrintConfList(t *testing.T) {
	l := &lab.Lab{Config: lab.Config{Name: "t"}, Hosts: []lab.Host{{Name: "h1", Socket: "/run/skiff/lab/t/h1.sock"}, {Name: "h2", Socket: "/run/skiff/lab/t/h2.sock"}}}
	var out bytes.Buffer
	if err := printConfList(Env{Stdout: &out}, l, "h2"); err != nil {
		t.Fatal(err)
	}
	list, err := libcni.ConfListFromBytes(out.Bytes())
	if err != nil {
		t.Fatalf("%v:\n%s", err, out.String())
	}
	// skiff-cni, then portmap where the machine has it.
	if len(list.Plugins) < 1 || list.Plugins[0].Network.Type != "skiff-cni" ||
		len(list.Plugins) == 2 && list.Plugins[1].Network.Type != "portmap" || len(list.Plugins) > 2 {
		t.Fatalf("plugins %+v, want skiff-cni (and portmap)", list.Plugins)
	}
	conf, err := cni.ParseConf(list.Plugins[0].Bytes)
	if err != nil {
		t.Fatalf("skiff-cni refuses the conflist's plugin: %v", err)
	}
	if conf.Socket != "/run/skiff/lab/t/h2.sock" {
		t.Errorf("socket %q, want h2's", conf.Socket)
	}
	if err := printConfList(Env{Stdout: &out}, l, "h9"); err == nil || !strings.Contains(err.Error(), `no host "h9"`) {
		t.Errorf("unknown host: err = %v", err)
	}
}

// TestSetLimit: skiff limit set changes the directions given and keeps
// the others; bad input is an error and changes nothing.
func TestSetLimit(t *testing.T) {
	s := func(v string) *string { return &v }
	cur := cluster.Limit{EgressRate: 1e8, EgressBurst: 8 << 20}
	for _, tc := range []struct {
		given [4]*string
		class string
		want  cluster.Limit
		err   string
	}{
		{[4]*string{s(""), s(""), s("10mbit"), s("")}, "", cluster.Limit{EgressRate: 1e8, EgressBurst: 8 << 20, IngressRate: 1e7, IngressBurst: cluster.MinBurst}, ""},
		{[4]*string{s("1gbit"), s("2mb"), s(""), s("")}, "", cluster.Limit{EgressRate: 1e9, EgressBurst: 16 << 20}, ""},
		{[4]*string{s("none"), s(""), s(""), s("")}, "", cluster.Limit{}, ""},
		{[4]*string{s(""), s(""), s(""), s("")}, "", cur, "nothing to set"},
		{[4]*string{s("-1mbit"), s(""), s(""), s("")}, "", cur, "0 or more"},
		{[4]*string{s("5tbit"), s(""), s(""), s("")}, "", cur, "above 1tbit"},
		{[4]*string{s("10furlongs"), s(""), s(""), s("")}, "", cur, "unknown unit"},
		{[4]*string{s(""), s(""), s(""), s("1mb")}, "", cur, "without a rate"},
		{[4]*string{s(""), s(""), s(""), s("")}, "high", cluster.Limit{EgressRate: 1e8, EgressBurst: 8 << 20, Class: "high"}, ""},
		{[4]*string{s(""), s(""), s(""), s("")}, "urgent", cur, "want high, normal or low"},
	} {
		got, err := setLimit(cur, tc.given, tc.class)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%v: err %v, want %q", tc.given, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%v: %+v, %v; want %+v", tc.given, got, err, tc.want)
		}
	}
}

// TestFindEndpoint: a container by its ID or a prefix that names it alone.
func TestFindEndpoint(t *testing.T) {
	ep := func(id, ifName string) api.EndpointStatus {
		return api.EndpointStatus{Endpoint: cluster.Endpoint{ContainerID: id, IfName: ifName}}
	}
	eps := []api.EndpointStatus{ep("abc", "eth0"), ep("abcd", "eth0"), ep("xyz", "eth0"), ep("xyz", "net1")}
	for _, tc := range []struct{ id, ifName, want, err string }{
		{"abc", "", "abc/eth0", ""}, {"abcd", "", "abcd/eth0", ""}, {"ab", "", "", "names 2 endpoints"},
		{"xyz", "", "", "give more of the ID, or --if"}, {"xyz", "net1", "xyz/net1", ""}, {"q", "", "", `no container "q"`},
	} {
		e, err := findEndpoint(eps, tc.id, tc.ifName)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s %s: err %v, want %q", tc.id, tc.ifName, err, tc.err)
			}
		} else if got := e.ContainerID + "/" + e.IfName; err != nil || got != tc.want {
			t.Errorf("%s %s: %s, %v; want %s", tc.id, tc.ifName, got, err, tc.want)
		}
	}
}

func TestMapsLine(t *testing.T) {
	got := mapsLine([]api.MapUse{{Name: "cache/skc_flows", Type: "Hash", Entries: 100, Capacity: 65536}, {Name: "sockets/sks_listen", Type: "SockHash", Entries: 15000, Capacity: 16384},
		{Name: "skv_sources", Type: "Hash", Entries: 3, Capacity: 16384}, {Name: "channels/skch_owners", Type: "LRUHash", Entries: 15000, Capacity: 16384}})
	want := "4 counted, fullest sockets/sks_listen (15000 of 16384); NEARLY FULL: sockets/sks_listen 15000 of 16384"
	if got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
}
