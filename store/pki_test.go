package store

import (
	"bytes"
	"crypto/x509"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func mode(t *testing.T, file string) os.FileMode {
	t.Helper()
	fi, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode().Perm()
}

// TestPKIGenerateAndReload: the first start creates the CA and the
// certificates, private to root; later starts reuse every one of them.
func TestPKIGenerateAndReload(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	p, created, err := EnsurePKI(dir)
	if err != nil || !created {
		t.Fatalf("EnsurePKI = %v, created %v", err, created)
	}
	server, issued, missing, err := p.EnsureServer([]string{"127.0.0.1", "localhost", "10.99.0.254"})
	if err != nil || !issued || len(missing) > 0 {
		t.Fatalf("EnsureServer = %v, issued %v, missing %v", err, issued, missing)
	}
	client, issued, err := p.EnsureClient("h1")
	if err != nil || !issued {
		t.Fatalf("EnsureClient = %v, issued %v", err, issued)
	}
	if m := mode(t, dir); m != 0o700 {
		t.Errorf("%s has mode %o, want 700", dir, m)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if m := mode(t, filepath.Join(dir, e.Name())); m != 0o600 {
			t.Errorf("%s has mode %o, want 600", e.Name(), m)
		}
	}
	before := map[string][]byte{}
	for _, f := range []string{filepath.Join(dir, CAFile), server.CertFile, client.CertFile} {
		before[f], _ = os.ReadFile(f)
	}

	p, created, err = EnsurePKI(dir)
	if err != nil || created {
		t.Fatalf("second EnsurePKI = %v, created %v", err, created)
	}
	if _, issued, _, err := p.EnsureServer([]string{"127.0.0.1", "10.99.0.254"}); err != nil || issued {
		t.Fatalf("second EnsureServer = %v, issued %v", err, issued)
	}
	if _, issued, err := p.EnsureClient("h1"); err != nil || issued {
		t.Fatalf("second EnsureClient = %v, issued %v", err, issued)
	}
	for f, data := range before {
		if now, _ := os.ReadFile(f); !bytes.Equal(now, data) {
			t.Errorf("%s changed on reload", f)
		}
	}

	cert, err := readCert(client.CertFile)
	if err != nil {
		t.Fatal(err)
	}
	if cert.Subject.CommonName != "h1" {
		t.Errorf("client CN %q, want h1", cert.Subject.CommonName)
	}
	if _, err := client.config(); err != nil {
		t.Errorf("client credentials: %v", err)
	}
	sc, _ := readCert(server.CertFile)
	for _, h := range []string{"127.0.0.1", "localhost", "10.99.0.254"} {
		if err := sc.VerifyHostname(h); err != nil {
			t.Errorf("server certificate: %v", err)
		}
	}
	if !slices.Contains(sc.ExtKeyUsage, x509.ExtKeyUsageClientAuth) {
		t.Errorf("server certificate cannot serve as a peer's client certificate")
	}
}

// TestPKIExpiry: certificates near their end are issued anew at start; a
// server certificate for other hosts is kept, its missing hosts named.
func TestPKIExpiry(t *testing.T) {
	dir := t.TempDir()
	p, _, err := EnsurePKI(dir)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	for _, name := range []string{"h1", serverName} {
		if _, err := p.Issue(name, name == serverName, []string{"127.0.0.1"}, dir, now.Add(-48*time.Hour), now.Add(24*time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	if _, issued, err := p.EnsureClient("h1"); err != nil || !issued {
		t.Errorf("client certificate expiring in a day: EnsureClient = %v, issued %v; want a new one", err, issued)
	}
	if _, issued, _, err := p.EnsureServer([]string{"127.0.0.1"}); err != nil || !issued {
		t.Errorf("server certificate expiring in a day: EnsureServer = %v, issued %v; want a new one", err, issued)
	}
	if _, _, missing, err := p.EnsureServer([]string{"127.0.0.1", "10.1.2.3"}); err != nil || !slices.Equal(missing, []string{"10.1.2.3"}) {
		t.Errorf("EnsureServer for a new host = %v, missing %v; want it kept, 10.1.2.3 missing", err, missing)
	}
}

// TestTLSFileErrors: every unusable file is an error at start that names it.
func TestTLSFileErrors(t *testing.T) {
	dir, other := t.TempDir(), t.TempDir()
	p, _, err := EnsurePKI(dir)
	if err != nil {
		t.Fatal(err)
	}
	op, _, err := EnsurePKI(other)
	if err != nil {
		t.Fatal(err)
	}
	good, _, err := p.EnsureClient("h1")
	if err != nil {
		t.Fatal(err)
	}
	foreign, _, err := op.EnsureClient("h1")
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	expired, err := p.Issue("old", false, nil, filepath.Join(dir, "old"), now.Add(-48*time.Hour), now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	future, err := p.Issue("new", false, nil, filepath.Join(dir, "new"), now.Add(time.Hour), now.Add(48*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	with := func(edit func(*TLS)) TLS { c := good; edit(&c); return c }
	for _, tc := range []struct {
		name string
		tls  TLS
		want []string
	}{
		{"missing key", with(func(c *TLS) { c.KeyFile = dir + "/nope.key" }), []string{dir + "/nope.key", "no such file"}},
		{"missing certificate", with(func(c *TLS) { c.CertFile = dir + "/nope.crt" }), []string{dir + "/nope.crt"}},
		{"missing CA", with(func(c *TLS) { c.CAFile = dir + "/nope.crt" }), []string{dir + "/nope.crt"}},
		{"key of another certificate", with(func(c *TLS) { c.KeyFile = foreign.KeyFile }), []string{good.CertFile, foreign.KeyFile}},
		{"certificate of another CA", with(func(c *TLS) { c.CertFile, c.KeyFile = foreign.CertFile, foreign.KeyFile }), []string{foreign.CertFile, good.CAFile}},
		{"expired certificate", with(func(c *TLS) { c.CertFile, c.KeyFile = expired.CertFile, expired.KeyFile }), []string{expired.CertFile, "expired"}},
		{"certificate not yet valid", with(func(c *TLS) { c.CertFile, c.KeyFile = future.CertFile, future.KeyFile }), []string{future.CertFile, "not valid before"}},
		{"key as CA", with(func(c *TLS) { c.CAFile = good.KeyFile }), []string{good.KeyFile, "no PEM certificate"}},
		{"no files", TLS{}, []string{"--etcd-cafile", "--etcd-insecure"}},
		{"files and insecure", with(func(c *TLS) { c.Insecure = true }), []string{"--etcd-insecure"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.tls.config()
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}
