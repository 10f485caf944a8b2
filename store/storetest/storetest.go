// Package storetest runs a real embedded etcd for tests.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"
	"testing"

	"github.com/skiffnet/skiff/store"
)

// New starts an embedded etcd in a temporary directory on free loopback
// ports and returns a store connected to it. Both stop when the test ends.
func New(tb testing.TB) (*store.Store, *store.Embedded) {
	tb.Helper()
	e := start(tb)
	tb.Cleanup(e.Close)
	s, err := store.Open([]string{e.URL})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { s.Close() })
	return s, e
}

// start picks two free ports and starts etcd on them. A port found free can
// be taken by another process (an outgoing connection's ephemeral port, a
// parallel test) before etcd binds it, so that case is tried again with new
// ports.
func start(tb testing.TB) *store.Embedded {
	const attempts = 5
	var err error
	for range attempts {
		client, peer := freeAddrs(tb)
		var e *store.Embedded
		e, err = store.StartEmbedded(context.Background(), tb.TempDir(), "http://"+client, "http://"+peer)
		if err == nil {
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

// freeAddrs returns two distinct free loopback addresses: both listeners are
// held until both are chosen.
func freeAddrs(tb testing.TB) (string, string) {
	a, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer a.Close()
	b, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer b.Close()
	return fmt.Sprint(a.Addr()), fmt.Sprint(b.Addr())
}
