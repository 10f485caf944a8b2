package store_test

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

// TestEmbeddedCluster: three embedded members sharing the cluster CA form
// one cluster over TLS; a fourth joins it (etcdctl member add, then
// Join); a client given every endpoint keeps reading and writing when a
// member stops; a member the initial cluster does not name is refused.
func TestEmbeddedCluster(t *testing.T) {
	pki := filepath.Join(t.TempDir(), "pki")
	p, _, err := store.EnsurePKI(pki)
	if err != nil {
		t.Fatal(err)
	}
	// One server certificate for every member, issued before they start
	// (they would otherwise race to write it).
	if _, _, _, err := p.EnsureServer([]string{"127.0.0.1", "localhost"}); err != nil {
		t.Fatal(err)
	}
	admin, _, err := p.EnsureClient(store.AdminName)
	if err != nil {
		t.Fatal(err)
	}
	addrs := storetest.FreeAddrs(t, 8)
	member := func(i int) store.EmbeddedConfig {
		return store.EmbeddedConfig{Dir: t.TempDir(), Name: fmt.Sprintf("m%d", i), PKIDir: pki,
			ClientURL: "https://" + addrs[2*i], PeerURL: "https://" + addrs[2*i+1],
			Log: slog.New(slog.NewTextHandler(testWriter{t}, nil))}
	}
	var initial []string
	for i := range 3 {
		initial = append(initial, fmt.Sprintf("m%d=%s", i, member(i).PeerURL))
	}
	start := func(cfg store.EmbeddedConfig) (*store.Embedded, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		e, err := store.StartEmbedded(ctx, cfg)
		if err == nil {
			t.Cleanup(e.Close)
		}
		return e, err
	}

	// A member is ready only once a majority runs: start them together.
	members := make([]*store.Embedded, 3)
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cfg := member(i)
			cfg.InitialCluster = strings.Join(initial, ",")
			members[i], errs[i] = start(cfg)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("member m%d: %v", i, err)
		}
	}
	var urls []string
	for _, e := range members {
		urls = append(urls, e.URL)
	}
	s, err := store.Open(urls, admin)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if _, err := s.Client.Put(ctx, "/k", "v1"); err != nil {
		t.Fatal(err)
	}

	// A fourth member joins the running cluster.
	m3 := member(3)
	// etcd adds a member only once every member has been connected for
	// five seconds (--strict-reconfig-check): "unhealthy cluster" until then.
	var added *clientv3.MemberAddResponse
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if added, err = s.Client.MemberAdd(ctx, []string{m3.PeerURL}); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	m3.InitialCluster, m3.Join = strings.Join(append(initial, "m3="+m3.PeerURL), ","), true
	if _, err := start(m3); err != nil {
		t.Fatalf("joining member: %v", err)
	}
	only3, err := store.Open([]string{m3.ClientURL}, admin)
	if err != nil {
		t.Fatal(err)
	}
	defer only3.Close()
	if resp, err := only3.Client.Get(ctx, "/k"); err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v1" {
		t.Fatalf("the joined member (id %x) reads %v, %v; want v1", added.Member.ID, resp, err)
	}

	// With one of four gone the other three are a majority: the client
	// finds them.
	members[0].Close()
	if _, err := s.Client.Put(ctx, "/k", "v2"); err != nil {
		t.Fatalf("write with a member down: %v", err)
	}
	if resp, err := only3.Client.Get(ctx, "/k"); err != nil || string(resp.Kvs[0].Value) != "v2" {
		t.Fatalf("read with a member down: %v, %v", resp, err)
	}

	// A member the initial cluster does not list.
	stray := member(0)
	stray.Dir, stray.InitialCluster = t.TempDir(), strings.Join(initial[1:], ",")
	if _, err := start(stray); err == nil || !strings.Contains(err.Error(), "m0") {
		t.Errorf("a member missing from the initial cluster: %v, want an error naming it", err)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
