package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/skiffnet/skiff/store"
)

// TestCertIssue: skiff cert issue writes a host's certificate, key and the
// CA certificate, private, and prints the command that joins the host.
func TestCertIssue(t *testing.T) {
	caDir, out := t.TempDir(), filepath.Join(t.TempDir(), "node2-pki")
	if _, _, err := store.EnsurePKI(caDir); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := run(t, "cert", "issue", "--ca-dir", caDir, "--name", "node2", "--out", out, "--etcd-endpoints", "https://10.0.0.1:2379")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if !strings.Contains(stdout, "skiffd --name node2 --etcd-endpoints https://10.0.0.1:2379 --etcd-cafile /etc/skiff/pki/ca.crt") {
		t.Errorf("no join command in %q", stdout)
	}
	creds := store.TLS{CAFile: filepath.Join(out, "ca.crt"), CertFile: filepath.Join(out, "node2.crt"), KeyFile: filepath.Join(out, "node2.key")}
	if cn, err := creds.CommonName(); err != nil || cn != "node2" {
		t.Errorf("common name %q, %v; want node2", cn, err)
	}
	for _, f := range []string{out, creds.CAFile, creds.CertFile, creds.KeyFile} {
		fi, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if want := os.FileMode(0o600); fi.IsDir() && fi.Mode().Perm() != 0o700 || !fi.IsDir() && fi.Mode().Perm() != want {
			t.Errorf("%s: mode %o", f, fi.Mode().Perm())
		}
	}
	if code, _, stderr := run(t, "cert", "issue", "--ca-dir", t.TempDir(), "--name", "x", "--out", t.TempDir()); code != 1 || !strings.Contains(stderr, "ca.crt") {
		t.Errorf("no CA: exit %d, %q; want an error naming ca.crt", code, stderr)
	}
	if code, _, _ := run(t, "cert", "issue", "--name", "x"); code != 2 {
		t.Errorf("missing flags: exit %d, want 2", code)
	}
}
