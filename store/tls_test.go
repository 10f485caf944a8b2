package store_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

// otherCluster is the PKI of another cluster, with a client certificate h1.
func otherCluster(t *testing.T) (*store.PKI, store.TLS) {
	t.Helper()
	p, _, err := store.EnsurePKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	c, _, err := p.EnsureClient("h1")
	if err != nil {
		t.Fatal(err)
	}
	return p, c
}

// TestTLSRefusals: a client the store does not accept, or a store the
// client does not trust, is an error from Open within seconds that names
// the file (or the endpoint) at fault, never a client that retries until
// its deadline. Without the handshake check Open returned nothing and the
// first read failed after 3 s with "context deadline exceeded".
func TestTLSRefusals(t *testing.T) {
	_, e := storetest.New(t)
	own, err := e.ClientTLS("h1")
	if err != nil {
		t.Fatal(err)
	}
	_, foreign := otherCluster(t)
	// A CA bundle that trusts the cluster's CA and another: the client
	// accepts its certificate from the other CA, the store does not.
	bundle := filepath.Join(t.TempDir(), "bundle.crt")
	a, _ := os.ReadFile(own.CAFile)
	b, _ := os.ReadFile(foreign.CAFile)
	if err := os.WriteFile(bundle, append(a, b...), 0o600); err != nil {
		t.Fatal(err)
	}
	// A store whose server certificate is for another address.
	wrongDir := t.TempDir()
	wp, _, err := store.EnsurePKI(wrongDir)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, err := wp.Issue("server", true, []string{"10.9.9.9"}, wrongDir, now.Add(-time.Hour), now.Add(store.LeafValidity)); err != nil {
		t.Fatal(err)
	}
	wrong := storetest.Start(t, store.EmbeddedConfig{PKIDir: wrongDir})
	wrongClient, _, err := wp.EnsureClient("h1")
	if err != nil {
		t.Fatal(err)
	}
	expired, err := e.PKI.Issue("h1", false, nil, t.TempDir(), now.Add(-48*time.Hour), now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name     string
		endpoint string
		tls      store.TLS
		want     []string
	}{
		{"another cluster's credentials", e.URL, foreign, []string{foreign.CAFile, "did not issue"}},
		{"certificate of another CA", e.URL, store.TLS{CAFile: bundle, CertFile: foreign.CertFile, KeyFile: foreign.KeyFile},
			[]string{foreign.CertFile, "refused the client certificate"}},
		{"server certificate for another host", wrong.URL, wrongClient, []string{wrong.URL, "another host"}},
		{"expired certificate", e.URL, store.TLS{CAFile: own.CAFile, CertFile: expired.CertFile, KeyFile: expired.KeyFile}, []string{expired.CertFile, "expired"}},
		{"missing key", e.URL, store.TLS{CAFile: own.CAFile, CertFile: own.CertFile, KeyFile: own.KeyFile + ".gone"}, []string{own.KeyFile + ".gone"}},
		{"plain client", e.URL, store.TLS{Insecure: true}, []string{e.URL, "--etcd-insecure"}},
		{"plain endpoint", strings.Replace(e.URL, "https:", "http:", 1), own, []string{"plain HTTP"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			s, err := store.Open([]string{tc.endpoint}, tc.tls)
			if err == nil {
				s.Close()
				t.Fatal("Open succeeded")
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("took %v to fail", d)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}

	// The cluster's own certificate works once the store knows its user:
	// before, the store refuses it at once, not after a timeout.
	s, err := store.Open([]string{e.URL}, own)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Ping(context.Background()); !errors.Is(err, store.ErrPermission) || errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("ping with a certificate of no user: %v, want ErrPermission", err)
	}
	admin, err := e.Admin()
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	if err := admin.AllowHost(context.Background(), "h1"); err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(context.Background()); err != nil {
		t.Fatalf("ping with the cluster's certificate: %v", err)
	}
}

// TestInsecure: --etcd-insecure serves and reaches the store on plain HTTP,
// and the server warns of it on every start.
func TestInsecure(t *testing.T) {
	var log bytes.Buffer
	dir := t.TempDir()
	for range 2 {
		log.Reset()
		e := storetest.Start(t, store.EmbeddedConfig{Dir: dir, Insecure: true, Log: slog.New(slog.NewTextHandler(&log, nil))})
		if !strings.HasPrefix(e.URL, "http://") {
			t.Errorf("insecure store at %s", e.URL)
		}
		if !strings.Contains(log.String(), "level=WARN") || !strings.Contains(log.String(), "plain HTTP") {
			t.Errorf("no warning of plain HTTP in %q", log.String())
		}
		s, err := store.Open([]string{e.URL}, store.TLS{Insecure: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Ping(context.Background()); err != nil {
			t.Fatalf("ping: %v", err)
		}
		s.Close()
		e.Close()
	}
	if _, err := os.Stat(filepath.Join(dir, "pki")); err == nil {
		t.Errorf("an insecure store made a PKI")
	}
}
