package scale

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// A process holds up to a few thousand sockets less than its open-file
// limit (which a process without CAP_SYS_RESOURCE cannot raise past the
// hard limit: 20 000 on some machines), so the flows part spreads its
// connections over worker processes (skiff scale-flows, run in a
// container's namespace and cgroup), perWorker each.
const perWorker = 15000

// Worker is skiff scale-flows, one worker process of the flows part:
//
//	serve PORT       listen on PORT and echo every byte of every connection;
//	                 print "listening" when ready
//	dial ADDR:PORT N open N connections to ADDR:PORT and keep them; print
//	                 "opened N FAILED [first error]"; then, for each line
//	                 "echo" read, send a byte on every one and print
//	                 "echoed N" for those it came back on
//
// Both run until in ends.
func Worker(ctx context.Context, args []string, in io.Reader, out io.Writer) error {
	switch {
	case len(args) == 2 && args[0] == "serve":
		return serve(args[1], in, out)
	case len(args) == 3 && args[0] == "dial":
		to, err := netip.ParseAddrPort(args[1])
		if err != nil {
			return err
		}
		n, err := strconv.Atoi(args[2])
		if err != nil || n < 1 {
			return fmt.Errorf("dial: count %q", args[2])
		}
		return dialWorker(to, n, in, out)
	}
	return fmt.Errorf("scale-flows: want serve PORT or dial ADDR:PORT N, not %q", args)
}

func serve(port string, in io.Reader, out io.Writer) error {
	ln, err := net.Listen("tcp4", ":"+port)
	if err != nil {
		return err
	}
	defer ln.Close()
	var mu sync.Mutex
	var conns []net.Conn
	defer func() {
		mu.Lock()
		closeAll(conns)
		mu.Unlock()
	}()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
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
	fmt.Fprintln(out, "listening")
	io.Copy(io.Discard, in)
	return nil
}

func dialWorker(to netip.AddrPort, n int, in io.Reader, out io.Writer) error {
	conns, failed, firstErr := dialMany(to, n)
	defer closeAll(conns)
	fmt.Fprintf(out, "opened %d %d %v\n", len(conns), failed, firstErr)
	lines := bufio.NewScanner(in)
	for lines.Scan() {
		if lines.Text() == "echo" {
			fmt.Fprintf(out, "echoed %d\n", echoAll(conns))
		}
	}
	return nil
}

// dialMany opens n connections to to, 64 at a time, and keeps them
// open: those it made, how many failed, and the first error.
func dialMany(to netip.AddrPort, n int) ([]net.Conn, int, error) {
	var mu sync.Mutex
	var conns []net.Conn
	var firstErr error
	var next, failed atomic.Int64
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			for next.Add(1) <= int64(n) {
				c, err := net.DialTimeout("tcp4", to.String(), 10*time.Second)
				mu.Lock()
				if err != nil {
					failed.Add(1)
					if firstErr == nil {
						firstErr = err
					}
				} else {
					conns = append(conns, c)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return conns, int(failed.Load()), firstErr
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
