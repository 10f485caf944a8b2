// Package storetest runs a real embedded etcd for tests.
package storetest

import (
	"context"
	"fmt"
	"net"
	"testing"

	"github.com/skiffnet/skiff/store"
)

// New starts an embedded etcd in a temporary directory on free loopback
// ports and returns a store connected to it. Both stop when the test ends.
func New(tb testing.TB) (*store.Store, *store.Embedded) {
	tb.Helper()
	e, err := store.StartEmbedded(context.Background(), tb.TempDir(),
		"http://"+freeAddr(tb), "http://"+freeAddr(tb))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(e.Close)
	s, err := store.Open([]string{e.URL})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { s.Close() })
	return s, e
}

func freeAddr(tb testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	return fmt.Sprint(l.Addr())
}
