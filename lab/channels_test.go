package lab

import (
	"context"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/channels"
	"github.com/skiffnet/skiff/policy"
)

// pyChanServer serves, on argv[1]: "bulk" — reads to EOF (the client
// half-closes), answers the SHA-256 of what it read, then 1 MiB of known
// bytes in writes of changing sizes and, with sendfile, another 1 MiB;
// "short" — writes 8 bytes and closes at once.
const pyChanServer = `
import hashlib, os, socket, sys, tempfile
mode, port = sys.argv[1], int(sys.argv[2])
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", port))
ls.listen(128)
print("listening", flush=True)
data = bytes(range(256)) * 4096
f = tempfile.TemporaryFile()
f.write(data)
while True:
    c, _ = ls.accept()
    c.settimeout(30)
    if mode == "short":
        c.sendall(b"12345678")
        c.close()
        continue
    h = hashlib.sha256()
    while True:
        b = c.recv(65536)
        if not b:
            break
        h.update(b)
    c.sendall(h.hexdigest().encode() + b"\n")
    i, n = 0, 1
    while i < len(data):
        c.sendall(data[i:i + n])
        i, n = i + n, n * 7 % 65521 + 1
    f.seek(0)
    c.sendfile(f)
    c.close()
`

// pyChanClient: "bulk" sends 4 MiB of random bytes in writes of 1 byte to
// 300 KB, half-closes, and checks the server's answer byte for byte
// ("blocking": the same on a blocking socket, whose reads after the
// half-close the kernel can fail with EAGAIN); "short N" opens N
// connections and reads each to its end.
const pyChanClient = `
import hashlib, random, socket, sys
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "short":
    bad = 0
    for _ in range(int(sys.argv[4])):
        s = socket.create_connection((host, port), timeout=10)
        got = b""
        while True:
            b = s.recv(64)
            if not b:
                break
            got += b
        s.close()
        bad += got != b"12345678"
    print("ok" if bad == 0 else "bad %d" % bad, flush=True)
    sys.exit(0)
rnd = random.Random(1)
data = rnd.randbytes(4 << 20)
s = socket.create_connection((host, port), timeout=None if mode == "blocking" else 30)
i = 0
while i < len(data):
    n = rnd.choice([1, 7, 100, 1448, 4096, 65536, 300000])
    s.sendall(data[i:i + n])
    i += n
s.shutdown(socket.SHUT_WR)
buf = b""
while True:
    b = s.recv(65536)
    if not b:
        break
    buf += b
line, _, rest = buf.partition(b"\n")
want = bytes(range(256)) * 4096
ok = line.decode() == hashlib.sha256(data).hexdigest() and rest == want + want
print("ok" if ok else "bad %r %d" % (line[:16], len(rest)), flush=True)
`

func channelsStatus(t *testing.T, l *Lab, host string) *channels.Status {
	t.Helper()
	return layerStatus(t, l, host, "channels", channels.StatusOf)
}

// TestChannels: two containers of one host get a fast channel: the data
// goes socket to socket (counters), byte-exact both ways with small and
// large writes, half-close and sendfile; the last bytes written before
// close reach the reader on every one of 10 000 short connections; an
// agent restart keeps channels; a rate-limited container takes none; a
// deny rule ends a channelled connection held through 100 000 others.
func TestChannels(t *testing.T) {
	l := newLab(t, Config{Name: "tchan", Hosts: 1, ContainersPerHost: 2, Mode: "channels"})
	dst, _ := l.IP("h1/c1")
	for _, mode := range []struct{ name, port string }{{"bulk", "7100"}, {"short", "7101"}} {
		srv := startPy(t, l, "h1/c1", pyChanServer, nil, mode.name, mode.port)
		if got := srv.line(t, 10*time.Second); got != "listening" {
			t.Fatalf("server: %q", got)
		}
	}
	before := channelsStatus(t, l, "h1").Counters
	if out := runPy(t, l, "h1/c2", pyChanClient, nil, "bulk", dst.String(), "7100"); strings.TrimSpace(out) != "ok" {
		t.Errorf("bulk transfer through a channel: %s", out)
	}
	after := channelsStatus(t, l, "h1").Counters
	t.Logf("bulk: %d sockets joined, %d messages redirected, %d directions on TCP", after["added"]-before["added"],
		after["redirected"]-before["redirected"], after["tcp_no_peer"]-before["tcp_no_peer"])
	if after["added"]-before["added"] != 2 || after["redirected"]-before["redirected"] < 100 {
		t.Errorf("the bulk connection did not take a channel: %v then %v", before, after)
	}
	shortConnectionsChannelled(t, l, dst)

	// A dual-stack listener's connections (AF_INET6 sockets with
	// IPv4-mapped addresses, as Go's and nginx's [::] listeners make) take
	// channels too.
	dual := startPy(t, l, "h1/c1", `
import socket
ls = socket.socket(socket.AF_INET6)
ls.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
ls.bind(("::", 7102))
ls.listen(16)
print("listening", flush=True)
while True:
    c, _ = ls.accept()
    c.sendall(b"hi")
    while True:
        b = c.recv(65536)
        if not b:
            break
        c.sendall(b)
    c.close()
`, nil)
	dual.line(t, 10*time.Second)
	before = channelsStatus(t, l, "h1").Counters
	out := runPy(t, l, "h1/c2", `
import socket, sys
s = socket.create_connection((sys.argv[1], 7102), timeout=10)
assert s.recv(2) == b"hi"
for i in range(100):
    s.sendall(bytes([i]) * 1000)
    got = b""
    while len(got) < 1000:
        got += s.recv(1000 - len(got))
    assert got == bytes([i]) * 1000
print("ok", flush=True)
`, nil, dst.String())
	if got := channelsStatus(t, l, "h1").Counters; strings.TrimSpace(out) != "ok" || got["added"]-before["added"] != 2 || got["redirected"]-before["redirected"] < 200 {
		t.Errorf("dual-stack listener: %q, counters %v then %v; want 2 sockets joined and the echoes redirected", out, before, got)
	}

	// A socket asking for zero-copy sends (whose completions a channel
	// would never give) sends through TCP.
	echoServer(t, l, "h1/c1", echoPort)
	zc := channelsStatus(t, l, "h1").Counters
	out = runPy(t, l, "h1/c2", `
import socket, sys
s = socket.create_connection((sys.argv[1], 7000), timeout=10)
s.setsockopt(socket.SOL_SOCKET, 60, 1)  # SO_ZEROCOPY
for _ in range(100):
    s.sendall(b"x" * 1000)
    got = b""
    while len(got) < 1000:
        got += s.recv(1000 - len(got))
print("ok", flush=True)
`, nil, dst.String())
	if got := channelsStatus(t, l, "h1").Counters; strings.TrimSpace(out) != "ok" || got["sockopt"]-zc["sockopt"] != 1 {
		t.Errorf("SO_ZEROCOPY: %q, counters %v then %v", out, zc, got)
	}

	// An agent restart keeps the channels: a connection held across it
	// goes on on its channel, and new ones take a channel.
	startPy(t, l, "h1/c1", pyEcho, nil, dst.String(), "7003")
	if _, err := eventually(10*time.Second, func() error { return roundTrips(l, "h1/c2", "tcp4", netip.AddrPortFrom(dst, 7003), 1) }); err != nil {
		t.Fatalf("echo server: %v", err)
	}
	held := startPy(t, l, "h1/c2", pyHold, nil, dst.String(), "7003")
	held.line(t, 10*time.Second)
	moving := channelsStatus(t, l, "h1").Counters
	restartAgents(t, l, "channels")
	restarted := channelsStatus(t, l, "h1").Counters
	time.Sleep(300 * time.Millisecond)
	if err := held.exited(); err != nil {
		t.Fatalf("the connection held across the restart ended: %v", err)
	}
	if got := channelsStatus(t, l, "h1").Counters; got["redirected"]-restarted["redirected"] < 2 || restarted["redirected"] == moving["redirected"] {
		t.Errorf("the held connection's echoes across the restart: redirected %d, %d after the restart, %d 300 ms later",
			moving["redirected"], restarted["redirected"], got["redirected"])
	}
	if out := runPy(t, l, "h1/c2", pyChanClient, nil, "bulk", dst.String(), "7100"); strings.TrimSpace(out) != "ok" {
		t.Errorf("bulk transfer after an agent restart: %s", out)
	}
	if got := channelsStatus(t, l, "h1").Counters; got["redirected"]-restarted["redirected"] < 100 {
		t.Errorf("after an agent restart no channel: %v then %v", restarted, got)
	}

	// A rate-limited container takes no channel: a channel would skip
	// the limit (its traffic stays on the veth's qdiscs).
	limitedTakesNoChannel(t, l, dst)

	// A deny rule ends a channelled connection (the one held since before
	// the restart), also after more short connections than any side table
	// of the layer's could remember (a table of clients, an LRU of 65 536,
	// once forgot the held one and the rule never ended it).
	for range 4 {
		if out := runPy(t, l, "h1/c2", pyChanClient, nil, "short", dst.String(), "7101", "25000"); strings.TrimSpace(out) != "ok" {
			t.Errorf("25 000 short connections: %s", out)
		}
	}
	time.Sleep(200 * time.Millisecond)
	if s := channelsStatus(t, l, "h1"); s.Sockets < 2 {
		t.Fatalf("%d sockets in the channel map with a connection held", s.Sockets)
	}
	denyEnds(t, l, held, dst)
	if n := channelsStatus(t, l, "h1").Counters["destroyed"]; n == 0 {
		t.Error("no channelled socket destroyed")
	}
}

// denyEnds writes a rule denying every container's traffic to dst and
// checks that the connection hold keeps ends within converges.
func denyEnds(t *testing.T, l *Lab, hold *proc, dst netip.Addr) {
	t.Helper()
	deny := policy.Rule{ID: "cut", Priority: 1, Action: policy.Deny, Src: netip.MustParsePrefix("10.244.0.0/16"), Dst: netip.PrefixFrom(dst, 32)}
	if err := l.PutPolicy(context.Background(), deny); err != nil {
		t.Fatal(err)
	}
	cut := time.Now()
	if got := hold.line(t, converges); !strings.HasPrefix(got, "err") {
		t.Errorf("the channelled connection after the deny rule: %q", got)
	} else {
		t.Logf("ended %v after the rule: %s", time.Since(cut).Round(time.Millisecond), got)
	}
}

// shortConnectionsChannelled: 10 000 sequential short connections from
// h1/c2 to dst:7101 all work and at least 9 000 take the channel.
func shortConnectionsChannelled(t *testing.T, l *Lab, dst netip.Addr) {
	t.Helper()
	start := time.Now()
	before := channelsStatus(t, l, "h1").Counters
	if out := runPy(t, l, "h1/c2", pyChanClient, nil, "short", dst.String(), "7101", "10000"); strings.TrimSpace(out) != "ok" {
		t.Errorf("10 000 short connections: %s", out)
	}
	after := channelsStatus(t, l, "h1").Counters
	t.Logf("10 000 short connections in %v: %d sockets joined, %d messages redirected", time.Since(start).Round(time.Millisecond),
		after["added"]-before["added"], after["redirected"]-before["redirected"])
	if after["redirected"]-before["redirected"] < 9000 {
		t.Errorf("short connections took the channel %d times of 10 000", after["redirected"]-before["redirected"])
	}
}

// limitedTakesNoChannel: with a limit on h1/c2, its bulk transfer to dst
// is byte-exact and takes no channel (the client's socket does not join:
// its container is off the layer; the server's joins only where it cannot
// tell its peer's container, a host socket's); the limit is lifted after.
func limitedTakesNoChannel(t *testing.T, l *Lab, dst netip.Addr) {
	t.Helper()
	skiff := skiffLimit(t)
	if out, err := skiff("set", l.prefix()+"h1-c2", "--egress", "1gbit"); err != nil {
		t.Fatalf("skiff limit set: %v\n%s", err, out)
	}
	time.Sleep(time.Second)
	before := channelsStatus(t, l, "h1").Counters
	if out := runPy(t, l, "h1/c2", pyChanClient, nil, "bulk", dst.String(), "7100"); strings.TrimSpace(out) != "ok" {
		t.Errorf("bulk transfer from a limited container: %s", out)
	}
	if got := channelsStatus(t, l, "h1").Counters; got["redirected"] != before["redirected"] || got["added"] > before["added"]+1 {
		t.Errorf("a limited container's connection took a channel: %v then %v", before, got)
	}
	if out, err := skiff("del", l.prefix()+"h1-c2"); err != nil {
		t.Fatalf("skiff limit del: %v\n%s", err, out)
	}
	time.Sleep(time.Second)
}

// TestChannelsFull: with the channel map full (capacity 2: one
// connection), a second connection stays on TCP, byte-exact.
func TestChannelsFull(t *testing.T) {
	l := newLab(t, Config{Name: "tchfull", Hosts: 1, ContainersPerHost: 2, Mode: "channels", AgentArgs: []string{"--channels-capacity", "2"}})
	dst, _ := l.IP("h1/c1")
	echoServer(t, l, "h1/c1", echoPort)
	hold := startPy(t, l, "h1/c2", pyHold, nil, dst.String(), "7000")
	hold.line(t, 10*time.Second)
	time.Sleep(200 * time.Millisecond)
	if s := channelsStatus(t, l, "h1"); s.Sockets != 2 {
		t.Fatalf("%d sockets in a map of 2 with one connection held", s.Sockets)
	}
	srv := startPy(t, l, "h1/c1", pyChanServer, nil, "bulk", "7100")
	srv.line(t, 10*time.Second)
	before := channelsStatus(t, l, "h1").Counters
	if out := runPy(t, l, "h1/c2", pyChanClient, nil, "bulk", dst.String(), "7100"); strings.TrimSpace(out) != "ok" {
		t.Errorf("bulk transfer with the channel map full: %s", out)
	}
	after := channelsStatus(t, l, "h1").Counters
	if after["add_failed"]-before["add_failed"] != 2 || after["redirected"] != before["redirected"] {
		t.Errorf("with the map full: %v then %v, want 2 failed joins and no redirect", before, after)
	}
	if err := hold.exited(); err != nil {
		t.Errorf("the channelled connection: %v", err)
	}
}

// TestChannelsHostSockets: in auto, the host sockets of two containers of
// one host (the sockets layer's, through the shim) get a channel:
// byte-exact both ways; a blocking reader after its own half-close gets
// every byte (the shim retries the kernel's spurious EAGAIN); the last
// bytes of 10 000 short connections arrive. The host sockets of programs
// under the seccomp profile (no shim to retry) stay out, and their
// blocking reader gets every byte too. Sockets of the containers' own
// namespaces take none in auto; a limited container takes none; an
// agent restart keeps a channel; a deny rule ends a channelled connection
// (the sockets layer ends it).
func TestChannelsHostSockets(t *testing.T) {
	l := newLab(t, Config{Name: "tchhost", Hosts: 1, ContainersPerHost: 2, Mode: "auto"})
	dst, _ := l.IP("h1/c1")
	for _, mode := range []struct{ name, port string }{{"bulk", "7100"}, {"short", "7101"}} {
		srv := startPy(t, l, "h1/c1", pyChanServer, nil, mode.name, mode.port)
		if got := srv.line(t, 10*time.Second); got != "listening" {
			t.Fatalf("server: %q", got)
		}
		to := netip.MustParseAddrPort(dst.String() + ":" + mode.port)
		waitListener(t, l, "h1", to, srv.exited)
		appWaitRoute(t, l, "h1/c2", to, 10*time.Second)
	}
	fast := counter(t, l, "h1", "connect_fast")
	for _, mode := range []string{"bulk", "blocking"} {
		before := channelsStatus(t, l, "h1").Counters
		if out := runPy(t, l, "h1/c2", pyChanClient, nil, mode, dst.String(), "7100"); strings.TrimSpace(out) != "ok" {
			t.Errorf("%s transfer through a channel of host sockets: %s", mode, out)
		}
		after := channelsStatus(t, l, "h1").Counters
		t.Logf("%s: %d sockets joined, %d messages redirected", mode, after["added"]-before["added"], after["redirected"]-before["redirected"])
		if after["added"]-before["added"] != 2 || after["redirected"]-before["redirected"] < 100 {
			t.Errorf("%s: the connection of host sockets took no channel: %v then %v", mode, before, after)
		}
	}
	if n := counter(t, l, "h1", "connect_fast") - fast; n != 2 {
		t.Errorf("%d connections on host sockets, want 2", n)
	}
	shortConnectionsChannelled(t, l, dst)

	// Programs under the seccomp profile get host sockets that stay out
	// of the channels (SKIFF_SO_NOCHANNEL): a channelled blocking read can
	// fail with EAGAIN, and they have no shim to retry it.
	seccompServer(t, l, "h1/c1", "h1/c2", 7102, "python3", "-c", pyChanServer, "bulk", "7102")
	for _, mode := range []string{"bulk", "blocking"} {
		before, fast := channelsStatus(t, l, "h1").Counters, counter(t, l, "h1", "connect_fast")
		if out := strings.TrimSpace(seccompRun(t, l, "h1/c2", time.Minute, "python3", "-c", pyChanClient, mode, dst.String(), "7102")); out != "ok" {
			t.Errorf("%s transfer between programs under the seccomp profile: %s", mode, out)
		}
		after := channelsStatus(t, l, "h1").Counters
		if n := counter(t, l, "h1", "connect_fast") - fast; n != 1 || after["opted_out"]-before["opted_out"] != 2 || after["added"] != before["added"] {
			t.Errorf("%s: %d connections on host sockets, channels counters %v then %v; want one, its two sockets opted out, none joined",
				mode, n, before, after)
		}
	}

	// Without the shim (container sockets), auto joins nothing: a
	// blocking reader there has no one to retry EAGAIN.
	echoServer(t, l, "h1/c1", echoPort)
	before := channelsStatus(t, l, "h1").Counters
	off := []string{"SKIFF_SOCKETS=off"}
	if out := runPy(t, l, "h1/c2", pyOnce, off, dst.String(), strconv.Itoa(echoPort)); !strings.HasPrefix(out, "ok") {
		t.Errorf("container sockets: %s", out)
	}
	if after := channelsStatus(t, l, "h1").Counters; after["added"] != before["added"] {
		t.Errorf("container sockets joined a channel in auto: %v then %v", before, after)
	}

	// A rate-limited container takes no channel.
	limitedTakesNoChannel(t, l, dst)

	// A deny rule ends a channelled connection of host sockets.
	echo := startPy(t, l, "h1/c1", pyEcho, nil, dst.String(), "7002")
	to := netip.AddrPortFrom(dst, 7002)
	waitListener(t, l, "h1", to, echo.exited)
	appWaitRoute(t, l, "h1/c2", to, 10*time.Second)
	before = channelsStatus(t, l, "h1").Counters
	hold := startPy(t, l, "h1/c2", pyHold, nil, dst.String(), "7002")
	hold.line(t, 10*time.Second)
	time.Sleep(200 * time.Millisecond)
	if got := channelsStatus(t, l, "h1").Counters; got["redirected"]-before["redirected"] < 2 {
		t.Fatalf("the held connection took no channel: %v then %v", before, got)
	}
	// An agent restart keeps it on the channel.
	restartAgents(t, l, "auto")
	restarted := channelsStatus(t, l, "h1").Counters
	time.Sleep(300 * time.Millisecond)
	if got := channelsStatus(t, l, "h1").Counters; hold.exited() != nil || got["redirected"]-restarted["redirected"] < 2 || got["fell_back"] != restarted["fell_back"] {
		t.Errorf("the held connection after an agent restart: %v, counters %v then %v", hold.exited(), restarted, got)
	}
	denyEnds(t, l, hold, dst)
}
