package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"
)

// listenPort is a socket a server must have open before its client starts.
type listenPort struct {
	Proto string // "tcp" or "udp"
	Port  int
}

func (l listenPort) String() string { return fmt.Sprintf("%s/%d", l.Proto, l.Port) }

// procNetFiles are read inside the server's namespace (/proc/net follows the
// reader's network namespace) to see which sockets are open.
var procNetFiles = []string{"/proc/net/tcp", "/proc/net/tcp6", "/proc/net/udp", "/proc/net/udp6"}

const (
	readyTimeout = 15 * time.Second
	readyPoll    = 50 * time.Millisecond
)

// waitListening polls the server target until every port in want is open,
// failing early when the server process exits.
func waitListening(ctx context.Context, lab Lab, target string, want []listenPort, srv *process) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	for {
		open, err := openPorts(ctx, lab, target, false)
		if err == nil && containsAll(open, want) {
			return nil
		}
		if srv.exited() {
			return fmt.Errorf("server exited before listening: %s", srv.describeExit())
		}
		select {
		case <-ctx.Done():
			if err != nil {
				return fmt.Errorf("server not listening on %v after %s: %w", want, readyTimeout, err)
			}
			return fmt.Errorf("server not listening on %v after %s", want, readyTimeout)
		case <-time.After(readyPoll):
		}
	}
}

// ListenerLab is a Lab whose servers may listen outside the target's own
// namespace: in sockets mode a container's listeners are host sockets.
type ListenerLab interface {
	Lab
	// Listening returns the addresses target listens on elsewhere (TCP),
	// ListeningUDP its UDP sockets elsewhere.
	Listening(ctx context.Context, target string) ([]netip.AddrPort, error)
	ListeningUDP(ctx context.Context, target string) ([]netip.AddrPort, error)
}

// openPorts lists the listening TCP and bound UDP ports in target's namespace
// (and, on a ListenerLab, its listeners elsewhere); with taken, the local
// ports of every TCP socket too, whatever its state.
func openPorts(ctx context.Context, lab Lab, target string, taken bool) (map[listenPort]bool, error) {
	open := map[listenPort]bool{}
	if ll, ok := lab.(ListenerLab); ok {
		aps, err := ll.Listening(ctx, target)
		if err != nil {
			return nil, fmt.Errorf("listeners of %s: %w", target, err)
		}
		for _, ap := range aps {
			open[listenPort{Proto: "tcp", Port: int(ap.Port())}] = true
		}
		if aps, err = ll.ListeningUDP(ctx, target); err != nil {
			return nil, fmt.Errorf("UDP sockets of %s: %w", target, err)
		}
		for _, ap := range aps {
			open[listenPort{Proto: "udp", Port: int(ap.Port())}] = true
		}
	}
	// grep -H prefixes each line with its file; a missing tcp6/udp6 (IPv6
	// disabled) only makes grep exit non-zero, so the exit code is ignored.
	cmd, err := lab.Command(ctx, target, "grep", append([]string{"-H", ""}, procNetFiles...)...)
	if err != nil {
		return nil, fmt.Errorf("probe sockets in %s: %w", target, err)
	}
	res, err := runCommand(ctx, cmd, readyTimeout)
	if err != nil {
		return nil, fmt.Errorf("probe sockets in %s: %w", target, err)
	}
	for p := range parseProcNet(res.Stdout, taken) {
		open[p] = true
	}
	return open, nil
}

// parseProcNet reads `grep -H "" /proc/net/{tcp,udp}*` output: lines of
// "FILE:  sl local_address rem_address st ...". TCP sockets count when in
// LISTEN (0A), UDP sockets when bound and unconnected (07); with taken,
// every TCP socket counts: a client's connection or TIME_WAIT on a local
// port (the lab's ephemeral range covers the bench's ports) makes a
// server's bind there fail with EADDRINUSE, SO_REUSEADDR or not.
func parseProcNet(out []byte, taken bool) map[listenPort]bool {
	open := map[listenPort]bool{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		file, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		proto := strings.TrimSuffix(file[strings.LastIndex(file, "/")+1:], "6")
		f := strings.Fields(rest)
		if len(f) < 4 || (proto != "tcp" && proto != "udp") {
			continue
		}
		if (proto == "tcp" && f[3] != "0A" && !taken) || (proto == "udp" && f[3] != "07") {
			continue
		}
		i := strings.LastIndex(f[1], ":")
		port, err := strconv.ParseUint(f[1][i+1:], 16, 16)
		if i < 0 || err != nil {
			continue
		}
		open[listenPort{Proto: proto, Port: int(port)}] = true
	}
	return open
}

func containsAll(open map[listenPort]bool, want []listenPort) bool {
	for _, w := range want {
		if !open[w] {
			return false
		}
	}
	return true
}
