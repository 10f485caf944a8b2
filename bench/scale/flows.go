package scale

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/lab"
)

// FlowsPoint is Flows TCP connections open at once from a pod to a pod of
// another host.
type FlowsPoint struct {
	Flows int `json:"flows"`
	// Opened connections, in OpenSeconds; Echoed: of them, those that
	// then carried a byte there and back (a connection that did not is a
	// drop).
	Opened      int     `json:"opened"`
	OpenSeconds float64 `json:"openSeconds"`
	Echoed      int     `json:"echoed"`
	// Table is the cache's connection table on the client's host: its
	// entries with every connection open, and its size.
	Table     int `json:"table"`
	TableSize int `json:"tableSize"`
	// SYNs is what the client host's cache did with the connections'
	// first packets (its from_container counters over the opening:
	// table_open, table_full — those take the overlay —, table_no_path,
	// new_unjudged, new_tracked); NewSYNs the same for 100 connections
	// made with every connection open: do new flows still get the fast
	// path?
	SYNs    map[string]uint64 `json:"syns"`
	NewSYNs map[string]uint64 `json:"newSYNs"`
	// Conntrack is the client host's conntrack entries with every
	// connection open (the flows the overlay carries); AgentRSSMiB its
	// agent's memory.
	Conntrack   int     `json:"conntrack"`
	AgentRSSMiB float64 `json:"agentRSSMiB"`
}

const flowPorts = 4 // server ports: one client address has ~55 000 ephemeral ports per port

func runFlows(ctx context.Context, o Options) ([]FlowsPoint, error) {
	most := 0
	for _, n := range o.Flows {
		most = max(most, n)
	}
	if err := raiseFiles(2*most + 10000); err != nil {
		return nil, err
	}
	var out []FlowsPoint
	for _, n := range o.Flows {
		p, err := flows(ctx, o, n)
		if err != nil {
			return out, fmt.Errorf("%d flows: %w", n, err)
		}
		o.logf("flows %d: %d opened in %.1f s, %d echoed; table %d of %d; SYNs %v; 100 new %v; conntrack %d; agent %.0f MiB",
			n, p.Opened, p.OpenSeconds, p.Echoed, p.Table, p.TableSize, p.SYNs, p.NewSYNs, p.Conntrack, p.AgentRSSMiB)
		out = append(out, p)
	}
	return out, nil
}

// flows runs on a lab of its own for each size: a closed connection stays
// in the table for the FIN timeout, and would count in the next size.
func flows(ctx context.Context, o Options, n int) (FlowsPoint, error) {
	const name = "sflows"
	p := FlowsPoint{Flows: n}
	o.logf("flows: lab %s (2 hosts, auto), %d connections", name, n)
	l, err := up(ctx, o, name, 2, 1)
	if err != nil {
		return p, err
	}
	defer down(o, name)
	srv, err := newEchoServer(l, "h2/c1")
	if err != nil {
		return p, err
	}
	defer srv.close()
	dst, err := l.IP("h2/c1")
	if err != nil {
		return p, err
	}
	before, err := counters(ctx, l, "h1")
	if err != nil {
		return p, err
	}
	start := time.Now()
	conns, err := dialMany(l, "h1/c1", dst, n)
	defer closeAll(conns)
	p.Opened, p.OpenSeconds = len(conns), time.Since(start).Seconds()
	if err != nil {
		return p, err
	}
	opened, err := counters(ctx, l, "h1")
	if err != nil {
		return p, err
	}
	p.SYNs = synOutcomes(before, opened)
	if p.Table, p.TableSize, err = tableEntries(ctx, l, "h1"); err != nil {
		return p, err
	}
	more, err := dialMany(l, "h1/c1", dst, 100)
	closeAll(more)
	if err != nil {
		return p, err
	}
	after, err := counters(ctx, l, "h1")
	if err != nil {
		return p, err
	}
	p.NewSYNs = synOutcomes(opened, after)
	p.Echoed = echoAll(conns)
	if p.Conntrack, err = conntrack(l, "h1"); err != nil {
		return p, err
	}
	h, err := l.Host("h1")
	if err != nil {
		return p, err
	}
	pr, err := readProc(h.AgentPID)
	p.AgentRSSMiB = pr.rssMiB
	return p, err
}

// echoServer echoes every byte on flowPorts ports inside a container.
type echoServer struct {
	lns   []net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func newEchoServer(l *lab.Lab, target string) (*echoServer, error) {
	s := &echoServer{}
	err := l.Do(target, func() error {
		for i := range flowPorts {
			ln, err := net.Listen("tcp4", ":"+strconv.Itoa(7200+i))
			if err != nil {
				return err
			}
			s.lns = append(s.lns, ln)
		}
		return nil
	})
	if err != nil {
		s.close()
		return nil, fmt.Errorf("echo server in %s: %w", target, err)
	}
	for _, ln := range s.lns {
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				s.mu.Lock()
				s.conns = append(s.conns, c)
				s.mu.Unlock()
				go func() {
					var b [1]byte
					for {
						if _, err := c.Read(b[:]); err != nil {
							return
						}
						if _, err := c.Write(b[:]); err != nil {
							return
						}
					}
				}()
			}
		}()
	}
	return s, nil
}

func (s *echoServer) close() {
	for _, ln := range s.lns {
		ln.Close()
	}
	s.mu.Lock()
	closeAll(s.conns)
	s.mu.Unlock()
}

// dialMany opens n connections from target to dst's flowPorts, 64 at a
// time, and keeps them open.
func dialMany(l *lab.Lab, target string, dst netip.Addr, n int) ([]net.Conn, error) {
	var mu sync.Mutex
	var conns []net.Conn
	var next atomic.Int64
	var failed atomic.Int64
	var errMu sync.Mutex
	var firstErr error
	note := func(err error) {
		errMu.Lock()
		firstErr = cmp.Or(firstErr, err)
		errMu.Unlock()
	}
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			err := l.Do(target, func() error {
				for {
					i := next.Add(1) - 1
					if i >= int64(n) {
						return nil
					}
					to := netip.AddrPortFrom(dst, uint16(7200+i%flowPorts))
					c, err := net.DialTimeout("tcp4", to.String(), 10*time.Second)
					if err != nil {
						failed.Add(1)
						note(err)
						continue
					}
					mu.Lock()
					conns = append(conns, c)
					mu.Unlock()
				}
			})
			if err != nil {
				note(err)
			}
		})
	}
	wg.Wait()
	if f := failed.Load(); f > 0 || firstErr != nil {
		return conns, fmt.Errorf("%d of %d connections failed: %v", f, n, firstErr)
	}
	return conns, nil
}

// echoAll sends a byte on every connection and counts those it came back
// on, 64 at a time.
func echoAll(conns []net.Conn) int {
	var ok atomic.Int64
	work := make(chan net.Conn)
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			var b [1]byte
			for c := range work {
				c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := c.Write([]byte{'x'}); err != nil {
					continue
				}
				if _, err := io.ReadFull(c, b[:]); err == nil && b[0] == 'x' {
					ok.Add(1)
				}
			}
		})
	}
	for _, c := range conns {
		work <- c
	}
	close(work)
	wg.Wait()
	return int(ok.Load())
}

func closeAll(conns []net.Conn) {
	for _, c := range conns {
		c.Close()
	}
}

// synOutcomes are the new-flow counters of the cache that moved from
// before to after, without their direction.
func synOutcomes(before, after map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for _, k := range []string{"table_open", "table_full", "table_no_path", "new_unjudged", "new_tracked", "new_denied"} {
		if d := after["from_container/"+k] - before["from_container/"+k]; d > 0 {
			out[k] = d
		}
	}
	return out
}

// counters are the cache's counters on host.
func counters(ctx context.Context, l *lab.Lab, host string) (map[string]uint64, error) {
	v, err := layerOf(ctx, l, host, "cache")
	return v.Counters, err
}

func layerOf(ctx context.Context, l *lab.Lab, host, name string) (api.Layer, error) {
	h, err := l.Host(host)
	if err != nil {
		return api.Layer{}, err
	}
	v, err := api.NewClient(h.Socket).Layer(ctx, name)
	if err != nil {
		return v, fmt.Errorf("%s on %s: %w", name, host, err)
	}
	return v, nil
}

// tableEntries is the cache's connection table on host: its entries and
// its size.
func tableEntries(ctx context.Context, l *lab.Lab, host string) (int, int, error) {
	v, err := layerOf(ctx, l, host, "cache")
	if err != nil {
		return 0, 0, err
	}
	var e cache.Entries
	if err := json.Unmarshal(v.Details, &e); err != nil {
		return 0, 0, fmt.Errorf("cache entries of %s: %w", host, err)
	}
	return e.Connections, int(e.ConnectionCapacity), nil
}

// conntrack is the number of conntrack entries in host's namespace.
func conntrack(l *lab.Lab, host string) (int, error) {
	n := 0
	err := l.Do(host, func() error {
		b, err := os.ReadFile("/proc/sys/net/netfilter/nf_conntrack_count")
		if err != nil {
			return err
		}
		n, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err
	})
	return n, err
}

// raiseFiles lets this process hold n open files.
func raiseFiles(n int) error {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	if lim.Cur >= uint64(n) {
		return nil
	}
	lim.Cur, lim.Max = uint64(n), max(lim.Max, uint64(n))
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("open files limit %d (fs.nr_open?): %w", n, err)
	}
	return nil
}
