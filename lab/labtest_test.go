package lab

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/lab/labtest"
)

// newLab brings up a lab for one test and tears it down afterwards, also
// when the test fails. Leftovers of an earlier crashed run of the same test
// are cleared first.
func newLab(t testing.TB, cfg Config) *Lab {
	t.Helper()
	if testing.Short() {
		t.Skip("lab integration test (-short)")
	}
	if os.Geteuid() != 0 {
		t.Skip("lab integration tests need root")
	}
	if cfg.BinDir == "" { // else another build's (TestUpgradeInPlace)
		cfg.BinDir = labtest.BinDir(t, "skiffd")
	}
	ctx := context.Background()
	if err := Down(ctx, cfg.Name); err != nil {
		t.Fatalf("clear leftovers: %v", err)
	}
	l, err := Up(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, h := range l.Hosts {
				log, _ := os.ReadFile(filepath.Join(l.hostDir(h.Name), "skiffd.log"))
				t.Logf("skiffd log of %s:\n%s", h.Name, tail(log, 3000))
			}
		}
		if err := Down(context.Background(), cfg.Name); err != nil {
			t.Errorf("lab down: %v", err)
		}
		if left := (&Lab{Config: Config{Name: cfg.Name}}).namespaces(); len(left) > 0 {
			t.Errorf("namespaces left behind: %v", left)
		}
	})
	return l
}

// restartAgents restarts every host's agent in mode, as an operator
// switching the data plane would.
func restartAgents(t *testing.T, l *Lab, mode string) {
	t.Helper()
	ctx := context.Background()
	l.Config.Mode = mode
	for _, h := range l.Hosts {
		if err := l.StopAgent(ctx, h.Name); err != nil {
			t.Fatal(err)
		}
		if err := l.StartAgent(ctx, h.Name); err != nil {
			t.Fatal(err)
		}
	}
}

// echoServer listens on TCP and UDP port in target and echoes until the test ends.
func echoServer(t *testing.T, l *Lab, target string, port int) {
	t.Helper()
	var tl net.Listener
	var ul net.PacketConn
	err := l.Do(target, func() (err error) {
		if tl, err = net.Listen("tcp4", fmt.Sprintf(":%d", port)); err != nil {
			return err
		}
		ul, err = net.ListenPacket("udp4", fmt.Sprintf(":%d", port))
		return err
	})
	if err != nil {
		t.Fatalf("echo server in %s: %v", target, err)
	}
	t.Cleanup(func() { tl.Close(); ul.Close() })
	go echoTCP(tl)
	go echoUDP(ul)
}

// echoUDP echoes every datagram c reads to its sender, until c is closed.
func echoUDP(c net.PacketConn) {
	buf := make([]byte, 65536)
	for {
		n, from, err := c.ReadFrom(buf)
		if err != nil {
			return
		}
		c.WriteTo(buf[:n], from)
	}
}

// queryUnconnected sends n queries from src to to on one unconnected UDP
// socket, as resolvers use: it takes an answer from any address, so each
// answer must come back echoed from to itself (a NAT's answer from the
// address the client asked, not the backend's).
func queryUnconnected(l *Lab, src string, to netip.AddrPort, n int) error {
	return l.Do(src, func() error {
		c, err := net.ListenPacket("udp4", ":0")
		if err != nil {
			return err
		}
		defer c.Close()
		buf := make([]byte, 1500)
		for i := range n {
			msg := fmt.Sprint("query ", i)
			if _, err := c.WriteTo([]byte(msg), net.UDPAddrFromAddrPort(to)); err != nil {
				return err
			}
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			k, from, err := c.ReadFrom(buf)
			if err != nil {
				return fmt.Errorf("%s: %w", msg, err)
			}
			got := from.(*net.UDPAddr).AddrPort()
			if got = netip.AddrPortFrom(got.Addr().Unmap(), got.Port()); string(buf[:k]) != msg || got != to {
				return fmt.Errorf("%s: answer %q from %s, want it from %s", msg, buf[:k], got, to)
			}
		}
		return nil
	})
}

// echoTCP echoes on every connection ln accepts, until ln is closed.
func echoTCP(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() { defer c.Close(); io.Copy(c, c) }()
	}
}

// agentOf returns the API client of host's agent.
// layerStatus returns a layer's section of host's status (pick), failing
// the test when the host does not run the layer.
func layerStatus[T any](t testing.TB, l *Lab, host, layer string, statusOf func(api.Status) (*T, error)) *T {
	t.Helper()
	st, err := agentOf(t, l, host).Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	v, err := statusOf(st)
	if err != nil {
		t.Fatal(err)
	}
	if v == nil {
		t.Fatalf("%s reports no %s layer (mode %s)", host, layer, st.Mode)
	}
	return v
}

// runs reports whether st says the layer runs.
func runs(st api.Status, layer string) bool {
	return slices.ContainsFunc(st.Layers, func(l api.Layer) bool { return l.Name == layer && l.On })
}

// countersOf is a layer's counters in st (nil when it does not run).
func countersIn(st api.Status, layer string) map[string]uint64 {
	for _, l := range st.Layers {
		if l.Name == layer && l.On {
			return l.Counters
		}
	}
	return nil
}

// cacheEntries reads the cache layer's entries on host (skiff layer cache).
func cacheEntries(t testing.TB, l *Lab, host string) *cache.Entries {
	t.Helper()
	v, err := agentOf(t, l, host).Layer(context.Background(), "cache")
	if err != nil {
		t.Fatal(err)
	}
	var e cache.Entries
	if err := json.Unmarshal(v.Details, &e); err != nil {
		t.Fatal(err)
	}
	return &e
}

func agentOf(t testing.TB, l *Lab, host string) *api.Client {
	t.Helper()
	h, err := l.Host(host)
	if err != nil {
		t.Fatal(err)
	}
	return api.NewClient(h.Socket)
}

// dial opens a connection from src to addr.
func dial(l *Lab, src, network string, addr netip.AddrPort, timeout time.Duration) (net.Conn, error) {
	var c net.Conn
	err := l.Do(src, func() (err error) {
		c, err = net.DialTimeout(network, addr.String(), timeout)
		return err
	})
	return c, err
}

// exchange sends a message over a fresh connection from src and checks the echo.
func exchange(l *Lab, src, network string, addr netip.AddrPort) error {
	c, err := dial(l, src, network, addr, 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	msg := []byte(fmt.Sprintf("%s %s -> %s", network, src, addr))
	if _, err := c.Write(msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if !bytes.Equal(got, msg) {
		return fmt.Errorf("echo %q, sent %q", got, msg)
	}
	return nil
}

func ping(ctx context.Context, l *Lab, src string, dst netip.Addr) error {
	cmd, err := l.Command(ctx, src, "ping", "-c", "1", "-W", "2", dst.String())
	if err != nil {
		return err
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("ping %s from %s: %w: %s", dst, src, err, out)
	}
	return nil
}

// eventually polls f until it succeeds or timeout passes.
func eventually(timeout time.Duration, f func() error) (time.Duration, error) {
	start := time.Now()
	for {
		err := f()
		if err == nil {
			return time.Since(start), nil
		}
		if time.Since(start) > timeout {
			return time.Since(start), err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stream keeps a TCP transfer running from src to dst until stopped, and
// reports how many bytes arrived and the first error.
type stream struct {
	mu       sync.Mutex
	received int64
	err      error
	stop     chan struct{}
	done     chan struct{}
}

func startStream(t *testing.T, l *Lab, src, dst string, port int) *stream {
	t.Helper()
	dstIP, _ := l.IP(dst)
	return startStreamVia(t, l, src, dst, port, netip.AddrPortFrom(dstIP, uint16(port)))
}

// startStreamVia is startStream through the address via (one that NAT on
// src's host turns into dst's port).
func startStreamVia(t *testing.T, l *Lab, src, dst string, port int, via netip.AddrPort) *stream {
	t.Helper()
	var ln net.Listener
	if err := l.Do(dst, func() (err error) { ln, err = net.Listen("tcp4", fmt.Sprintf(":%d", port)); return err }); err != nil {
		t.Fatal(err)
	}
	c, err := dial(l, src, "tcp4", via, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	s := &stream{stop: make(chan struct{}), done: make(chan struct{})}
	srv, err := ln.Accept()
	ln.Close()
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := srv.Read(buf)
			s.mu.Lock()
			s.received += int64(n)
			s.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	go func() {
		defer close(s.done)
		defer c.Close()
		defer srv.Close()
		buf := make([]byte, 16<<10)
		for {
			select {
			case <-s.stop:
				return
			default:
			}
			c.SetWriteDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.Write(buf); err != nil {
				s.mu.Lock()
				s.err = err
				s.mu.Unlock()
				return
			}
			time.Sleep(time.Millisecond) // a steady flow, not a flood
		}
	}()
	return s
}

func (s *stream) bytes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.received
}

func (s *stream) finish() error {
	close(s.stop)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// progresses checks that s moves forward within timeout.
func (s *stream) progresses(timeout time.Duration) error {
	before := s.bytes()
	_, err := eventually(timeout, func() error {
		if s.bytes() <= before {
			return errors.New("no bytes arrived")
		}
		return nil
	})
	return err
}

// stops waits (up to timeout) until s moves no byte for quiet, and says
// how long that took (quiet included).
func (s *stream) stops(timeout, quiet time.Duration) (time.Duration, error) {
	return eventually(timeout, func() error {
		if s.progresses(quiet) == nil {
			return errors.New("still moves")
		}
		return nil
	})
}

// paths joins an endpoint's layers that are on, and why the others are off.
func paths(e api.EndpointStatus) (on, off string) {
	ons, offs := e.Paths()
	return strings.Join(ons, ","), strings.Join(offs, "; ")
}
