package store_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/store/storetest"
)

// TestConnectivity: the connection to the store is reported lost when the
// store stops and back within about a second of its return, however long
// it was gone (gRPC alone would wait up to two minutes to reconnect).
func TestConnectivity(t *testing.T) {
	dir := t.TempDir()
	cfg := store.EmbeddedConfig{Dir: dir, Insecure: true}
	e := storetest.Start(t, cfg)
	s, err := store.Open([]string{e.URL}, store.TLS{Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := s.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	up := s.Connectivity(ctx, 500*time.Millisecond)
	expect := func(want bool, within time.Duration) {
		t.Helper()
		select {
		case got := <-up:
			if got != want {
				t.Fatalf("connectivity %v, want %v", got, want)
			}
		case <-time.After(within):
			t.Fatalf("no change to %v within %v", want, within)
		}
	}
	e.Close()
	expect(false, 5*time.Second)
	time.Sleep(12 * time.Second) // gRPC alone would next try at about 16 s
	cfg.ClientURL = e.URL
	cfg.PeerURL = "http://" + freeAddr(t)
	back, err := store.StartEmbedded(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	start := time.Now()
	expect(true, 3*time.Second)
	t.Logf("back %v after the store", time.Since(start))
	cancel()
	if _, open := <-up; open {
		t.Error("channel still open after its context ended")
	}
}

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return fmt.Sprint(l.Addr())
}
