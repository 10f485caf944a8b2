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
		e, err := startEmbedded(context.Background(), "node1", dir, listen, peer, &creds, log)
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
