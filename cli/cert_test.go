package cli

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

// TestCertIssue: skiff cert issue writes a host's certificate, key and the
// CA certificate, private, and prints the command that joins the host.
func TestCertIssue(t *testing.T) {
	caDir, out := t.TempDir(), filepath.Join(t.TempDir(), "node2-pki")
	if _, _, err := store.EnsurePKI(caDir); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := run(t, "cert", "issue", "--ca-dir", caDir, "--name", "node2", "--out", out, "--etcd-endpoints", "https://127.0.0.1:1")
	// The certificate is issued, but the store did not answer: a failure,
	// with what to run when it does.
	if code != 1 || !strings.Contains(stderr, "once the store answers: skiff cert allow --ca-dir "+caDir+" --name node2") {
		t.Fatalf("exit %d: %s; want 1, and what to run when the store answers", code, stderr)
	}
	// node2 cannot reach the store at this machine's loopback.
	if !strings.Contains(stdout, "skiffd --name node2 --etcd-endpoints https://STORE-ADDRESS:2379 --etcd-cafile /etc/skiff/pki/ca.crt") ||
		!strings.Contains(stderr, "is this machine's loopback") {
		t.Errorf("join command %q, %q; want the store's network address asked for", stdout, stderr)
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

// TestCertIssueMakesUser: with the store at hand, skiff cert issue also
// makes the host's user and role: the new certificate reads the store and
// writes its host's keys, and nothing of another's.
func TestCertIssueMakesUser(t *testing.T) {
	_, e := storetest.New(t)
	out := filepath.Join(t.TempDir(), "node2-pki")
	code, stdout, stderr := run(t, "cert", "issue", "--ca-dir", e.PKI.Dir, "--name", "node2", "--out", out, "--etcd-endpoints", e.URL)
	if code != 0 || !strings.Contains(stdout, "made node2's user and role") {
		t.Fatalf("exit %d: %s %s", code, stdout, stderr)
	}
	s, err := store.Open([]string{e.URL}, store.TLS{CAFile: filepath.Join(out, "ca.crt"), CertFile: filepath.Join(out, "node2.crt"), KeyFile: filepath.Join(out, "node2.key")})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if _, err := s.EnsureCluster(ctx, cluster.Config{CIDR: netip.MustParsePrefix("10.244.0.0/16"), HostPrefix: 24, VNI: 1, VXLANPort: 4789}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Txn(ctx, nil, []clientv3.Op{clientv3.OpPut(store.HostKey("node2"), "{}")}); err != nil {
		t.Errorf("node2 writes its record: %v", err)
	}
	if _, err := s.Txn(ctx, nil, []clientv3.Op{clientv3.OpPut(store.HostKey("node3"), "{}")}); !errors.Is(err, store.ErrPermission) {
		t.Errorf("node2 writes node3's record: %v", err)
	}
	if code, _, stderr := run(t, "cert", "allow", "--ca-dir", e.PKI.Dir, "--name", "root", "--etcd-endpoints", e.URL); code != 1 || !strings.Contains(stderr, "reserved") {
		t.Errorf("allow root: exit %d, %q", code, stderr)
	}
}

func TestLoopbackURL(t *testing.T) {
	for url, want := range map[string]bool{
		"https://127.0.0.1:2379": true, "https://localhost:2379": true, "https://127.0.0.1:1,https://[::1]:2379": true,
		"https://10.0.0.1:2379": false, "https://127.0.0.1:2379,https://10.0.0.2:2379": false, "https://node1:2379": false,
	} {
		if got := loopbackURL(url); got != want {
			t.Errorf("loopbackURL(%q) = %v", url, got)
		}
	}
}
