package lab

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// pyFloodCount counts the UDP bytes it receives on argv[1] and, once
// they stop for a second (or none came for argv[2] seconds), prints
// "bps N": their rate from the first to the last datagram.
const pyFloodCount = `
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(0.5)
print("ready", flush=True)
total, first, last, start = 0, None, None, time.time()
while True:
    try:
        d = s.recv(65536)
    except socket.timeout:
        if first is not None and time.time() - last > 1 or first is None and time.time() - start > float(sys.argv[2]):
            break
        continue
    last = time.time()
    if first is None:
        first = last
    total += len(d)
print("bps %d" % (total * 8 / max(last - first, 0.001) if first else 0), flush=True)
`

// pyFloodEscape sends 1400-byte UDP datagrams to argv[2]:argv[3] as fast
// as it can for argv[4] seconds, the way argv[1] says: "priority" with
// SO_PRIORITY 0x5c0000 (the handle of skiff's HTB: its direct queue), or
// "bypass" as Ethernet frames from a packet socket with
// PACKET_QDISC_BYPASS (past the interface's qdisc altogether).
const pyFloodEscape = `
import socket, struct, sys, time
mode, dst, port, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
payload = b"x" * 1400
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.connect((dst, port))
end = time.time() + secs
if mode == "priority":
    u.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, 0x5c0000)
    while time.time() < end:
        try:
            u.send(payload)
        except OSError:
            pass
    sys.exit(0)
src = u.getsockname()[0]
u.send(b"a")  # resolves the gateway
time.sleep(0.3)
for line in open("/proc/net/route").read().splitlines()[1:]:
    f = line.split()
    if f[1] == "00000000":
        ifname, gw = f[0], socket.inet_ntoa(struct.pack("<I", int(f[2], 16)))
mac = [bytes.fromhex(l.split()[3].replace(":", "")) for l in open("/proc/net/arp").read().splitlines()[1:] if l.split()[0] == gw][0]
p = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
p.setsockopt(263, 20, 1)  # SOL_PACKET, PACKET_QDISC_BYPASS
p.bind((ifname, 0))
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 0, 0x4000, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(dst))
words = sum(struct.unpack("!10H", ip))
words = (words & 0xffff) + (words >> 16)
ip = ip[:10] + struct.pack("!H", ~((words & 0xffff) + (words >> 16)) & 0xffff) + ip[12:]
frame = mac + p.getsockname()[4] + b"\x08\x00" + ip + struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
while time.time() < end:
    try:
        p.send(frame)
    except OSError:
        pass
`

// TestLimitsNotEscaped: a container's egress limit holds whatever it does
// to send around it, in every layer that carries its datagrams: a
// priority naming skiff's HTB (its direct queue: now none, such packets
// are dropped) and a packet socket that bypasses the interface's qdisc
// (held near the limit by the host veth's policer, police.c). Each
// escaped a 20 Mbit/s limit at 600 Mbit/s and more before.
func TestLimitsNotEscaped(t *testing.T) {
	const rate = 20e6
	for _, mode := range []string{"overlay", "cache", "auto"} {
		t.Run(mode, func(t *testing.T) {
			l := newLab(t, Config{Name: "tesc" + mode[:2], Hosts: 2, ContainersPerHost: 1, Mode: mode})
			if out, err := skiffLimit(t)("set", l.prefix()+"h1-c1", "--egress", "20mbit"); err != nil {
				t.Fatalf("skiff limit set: %v\n%s", err, out)
			}
			time.Sleep(1500 * time.Millisecond)
			dst, _ := l.IP("h2/c1")
			for i, attack := range []string{"priority", "bypass"} {
				port := strconv.Itoa(7400 + i)
				rcv := startPy(t, l, "h2/c1", pyFloodCount, nil, port, "6")
				if got := rcv.line(t, 10*time.Second); got != "ready" {
					t.Fatalf("receiver: %q", got)
				}
				if out := runPyErr(l, "h1/c1", pyFloodEscape, attack, dst.String(), port, "3"); strings.TrimSpace(out) != "" {
					t.Fatalf("%s sender: %s", attack, out)
				}
				got := rcv.line(t, 10*time.Second)
				var bps float64
				if f := strings.Fields(got); len(f) == 2 && f[0] == "bps" {
					bps, _ = strconv.ParseFloat(f[1], 64)
				}
				t.Logf("%s: %.1f Mbit/s received under a %.0f Mbit/s limit", attack, bps/1e6, rate/1e6)
				if !strings.HasPrefix(got, "bps ") || bps > 1.5*rate {
					t.Errorf("%s: %q, want at most 1.5 × the limit of %.0f Mbit/s", attack, got, rate/1e6)
				}
			}
		})
	}
}
