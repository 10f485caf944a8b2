// Package storetest runs a real embedded etcd for tests.
package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"syscall"
	"testing"

	"github.com/skiffnet/skiff/store"
)

// New starts an embedded etcd over TLS in a temporary directory on free
// loopback ports and returns a store connected to it with the
// administrator's certificate. Both stop when the test ends.
func New(tb testing.TB) (*store.Store, *store.Embedded) {
	tb.Helper()
	e := Start(tb, store.EmbeddedConfig{})
	t, err := e.ClientTLS(store.AdminName)
	if err != nil {
		tb.Fatal(err)
	}
	s, err := store.Open([]string{e.URL}, t)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { s.Close() })
	return s, e
}

// Start starts etcd as cfg says, in a temporary directory unless cfg names
// one, on two free loopback ports; it stops when the test ends. A port
// found free can be taken by another process (an outgoing connection's
// ephemeral port, a parallel test) before etcd binds it, so that case is
// tried again with new ports.
func Start(tb testing.TB, cfg store.EmbeddedConfig) *store.Embedded {
	tb.Helper()
	const attempts = 5
	if cfg.Dir == "" {
		cfg.Dir = tb.TempDir()
	}
	scheme := "https://"
	if cfg.Insecure {
		scheme = "http://"
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.NewTextHandler(tbWriter{tb}, nil))
	}
	var err error
	for range attempts {
		client, peer := freeAddrs(tb)
		cfg.ClientURL, cfg.PeerURL = scheme+client, scheme+peer
		var e *store.Embedded
		e, err = store.StartEmbedded(context.Background(), cfg)
		if err == nil {
			tb.Cleanup(e.Close)
			return e
		}
		if !errors.Is(err, syscall.EADDRINUSE) {
			break
		}
		tb.Logf("embedded etcd: %v; trying other ports", err)
	}
	tb.Fatal(err)
	return nil
}

// tbWriter logs the server's messages with the test's.
type tbWriter struct{ tb testing.TB }

func (w tbWriter) Write(p []byte) (int, error) {
	w.tb.Logf("%s", bytes.TrimRight(p, "\n"))
	return len(p), nil
}

// freeAddrs returns two distinct free loopback addresses.
func freeAddrs(tb testing.TB) (string, string) {
	a := FreeAddrs(tb, 2)
	return a[0], a[1]
}

// FreeAddrs returns n distinct free loopback addresses (HOST:PORT): every
// listener is held until all are chosen.
func FreeAddrs(tb testing.TB, n int) []string {
	tb.Helper()
	var out []string
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			tb.Fatal(err)
		}
		defer l.Close()
		out = append(out, fmt.Sprint(l.Addr()))
	}
	return out
}
