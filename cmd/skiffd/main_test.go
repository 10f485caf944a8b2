package main

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/store"
)

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// TestEmbeddedJoinInstructions: the first start of the embedded store
// creates the PKI, gives the agent its own certificate and logs once how
// another host joins; a restart reuses it all and says nothing of joining.
func TestEmbeddedJoinInstructions(t *testing.T) {
	dir := t.TempDir()
	for i, wantJoin := range []bool{true, false} {
		var out bytes.Buffer
		log := slog.New(slog.NewTextHandler(&out, nil))
		var creds store.TLS
		listen := fmt.Sprintf("https://127.0.0.1:%d", freePort(t))
		peer := fmt.Sprintf("https://127.0.0.1:%d", freePort(t))
		cfg := store.EmbeddedConfig{Dir: dir, ClientURL: listen, PeerURL: peer, Log: log}
		e, err := startEmbedded(context.Background(), "node1", cfg, &creds, log)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkCredentials(creds, "node1", log); err != nil {
			t.Errorf("start %d: %v", i, err)
		}
		s, err := store.Open([]string{e.URL}, creds)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Ping(context.Background()); err != nil {
			t.Errorf("start %d: the agent's certificate: %v", i, err)
		}
		s.Close()
		e.Close()
		if got := strings.Contains(out.String(), "skiff cert issue --ca-dir "+dir+"/pki --name HOST"); got != wantJoin {
			t.Errorf("start %d: join instructions logged %v, want %v:\n%s", i, got, wantJoin, out.String())
		}
		if strings.Contains(out.String(), "PRIVATE KEY") {
			t.Errorf("start %d: a key in the log:\n%s", i, out.String())
		}
	}
}

// TestMemberFlags: an initial cluster names the embedded member after its
// host; joining needs one; an unknown state is refused saying what is valid.
func TestMemberFlags(t *testing.T) {
	const initial = "n1=https://10.0.0.1:2380,n2=https://10.0.0.2:2380,n3=https://10.0.0.3:2380"
	for _, tc := range []struct {
		initial, state string
		want           store.EmbeddedConfig
		err            string
	}{
		{"", "new", store.EmbeddedConfig{}, ""},
		{initial, "new", store.EmbeddedConfig{Name: "n2", InitialCluster: initial}, ""},
		{initial, "existing", store.EmbeddedConfig{Name: "n2", InitialCluster: initial, Join: true}, ""},
		{"", "existing", store.EmbeddedConfig{}, "needs --embedded-etcd-initial-cluster"},
		{initial, "joined", store.EmbeddedConfig{}, `"joined": choose new or existing`},
	} {
		var cfg store.EmbeddedConfig
		err := memberFlags(&cfg, "n2", tc.initial, tc.state)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q %q: %v, want an error mentioning %q", tc.initial, tc.state, err, tc.err)
			}
			continue
		}
		if err != nil || cfg != tc.want {
			t.Errorf("%q %q: %+v, %v; want %+v", tc.initial, tc.state, cfg, err, tc.want)
		}
	}
}

// TestDeployConfig: the config file make install puts in place is one
// skiffd accepts.
func TestDeployConfig(t *testing.T) {
	if err := run([]string{"--config", "../../deploy/skiffd.conf", "--version"}); err != nil {
		t.Fatal(err)
	}
}
