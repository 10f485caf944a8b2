#!/usr/bin/env bash
# Tests for skiff-perf (run by `make -C perf test`):
#   - every test against a local server: exit 0, errors 0, sane JSON
#   - udp_rr against a lossy/late fake server: losses counted, late replies discarded
#   - a server with --corrupt-every 50: tcp_rr, udp_rr, tcp_crr exit 2 with errors > 0
#   - bad usage exits 64, an unreachable server exits 1, the server exits 0 on SIGTERM
#   - memcached load (persistent and --new-conn) if memcached is installed
# SKIFF_PERF=path selects the binary (default ./skiff-perf).
set -euo pipefail

cd "$(dirname "$0")"
BIN=${SKIFF_PERF:-./skiff-perf}
TMP=$(mktemp -d)
PIDS=()
PASSED=0

cleanup() {
	local pid
	for pid in "${PIDS[@]}"; do
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
	rm -rf "$TMP"
}
trap cleanup EXIT

fail() {
	echo "FAIL: $*" >&2
	if [[ -s $TMP/client.err ]]; then
		echo "--- client stderr:" >&2
		head -n 20 "$TMP/client.err" >&2
	fi
	exit 1
}

pass() {
	PASSED=$((PASSED + 1))
	echo "ok   $*"
}

[[ -x $BIN ]] || fail "$BIN not built (run make)"

# ---- JSON checker -------------------------------------------------------------------
cat >"$TMP/check.py" <<'EOF'
import json, sys

mode, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
count = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else 0
lines = out.splitlines()
assert len(lines) == 1, f"expected exactly one line on stdout, got {len(lines)}: {out!r}"
r = json.loads(lines[0])
ints = ["transactions", "errors", "lost"]
floats = ["duration_s", "rate", "p50_us", "p90_us", "p99_us", "p999_us", "min_us",
          "max_us", "mean_us"]
if name == "memcached":
    ints += ["gets", "sets", "hits", "misses"]
assert set(r) == set(["test"] + ints + floats), f"unexpected keys {sorted(r)}"
assert r["test"] == name, r["test"]
for k in ints:
    assert isinstance(r[k], int) and r[k] >= 0, (k, r[k])
for k in floats:
    assert isinstance(r[k], (int, float)) and r[k] >= 0, (k, r[k])

if mode == "errors":
    assert r["errors"] > 0, f"expected errors > 0: {r}"
    sys.exit(0)

assert r["errors"] == 0, r
assert r["transactions"] > 0 and r["rate"] > 0 and r["duration_s"] > 0, r
assert (r["min_us"] <= r["p50_us"] <= r["p90_us"] <= r["p99_us"] <= r["p999_us"]
        <= r["max_us"]), r
assert r["min_us"] <= r["mean_us"] <= r["max_us"], r
assert r["min_us"] > 0, r
if count:
    assert r["transactions"] + r["lost"] == count, f"expected {count} transactions: {r}"
if name != "udp_rr":
    assert r["lost"] == 0, r
if mode == "lossy":
    assert r["lost"] > 0, f"the lossy server drops datagrams, expected lost > 0: {r}"
if name == "memcached":
    assert r["gets"] + r["sets"] == r["transactions"], r
    assert r["hits"] + r["misses"] == r["gets"], r
    assert r["gets"] > 0 and r["sets"] > 0 and r["hits"] > 0, r
    assert 5 <= r["gets"] / r["sets"] <= 20, f"GET:SET should be about 10:1: {r}"
EOF

# run_client ARGS...: sets OUT (stdout) and RC; stderr goes to $TMP/client.err
run_client() {
	RC=0
	OUT=$(timeout 120 "$BIN" client "$@" 2>"$TMP/client.err") || RC=$?
}

# expect_ok NAME [COUNT] -- ARGS...: the run must succeed with a sane result
expect_ok() {
	local name=$1 count=$2
	shift 3
	run_client --host 127.0.0.1 --test "$name" "$@"
	[[ $RC -eq 0 ]] || fail "$name $*: exit $RC, want 0; stdout: $OUT"
	python3 "$TMP/check.py" ok "$name" "$OUT" "$count" || fail "$name $*: bad result"
	pass "$name $*  ->  $(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("%d txns, %.0f/s, p50 %.1f us" % (r["transactions"], r["rate"], r["p50_us"]))' "$OUT")"
}

# free_port: prints a port in 20000..29998 whose tcp P, P+1 and udp P were free just now
free_port() {
	python3 - "$1" <<'EOF'
import socket, sys
seed = int(sys.argv[1])
for i in range(200):
    p = 20000 + (seed + i * 97) % 9998
    socks = []
    try:
        for port, kind in ((p, socket.SOCK_STREAM), (p + 1, socket.SOCK_STREAM),
                           (p, socket.SOCK_DGRAM)):
            s = socket.socket(socket.AF_INET, kind)
            socks.append(s)
            s.bind(("127.0.0.1", port))
        print(p)
        sys.exit(0)
    except OSError:
        pass
    finally:
        for s in socks:
            s.close()
sys.exit("no free port")
EOF
}

# start_server ARGS...: starts a server on a free port; sets SERVER_PORT, SERVER_PID
start_server() {
	local try port pid log
	for try in 1 2 3 4 5 6 7 8 9 10; do
		port=$(free_port $(($$ + try * 1013 + RANDOM)))
		log="$TMP/server-$port.log"
		"$BIN" server --bind 127.0.0.1 --port "$port" "$@" 2>"$log" &
		pid=$!
		PIDS+=("$pid")
		for _ in $(seq 100); do
			if grep -q ready "$log"; then
				SERVER_PORT=$port
				SERVER_PID=$pid
				return 0
			fi
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.05
		done
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
		echo "note: server on port $port did not start ($(cat "$log")), retrying" >&2
	done
	fail "cannot start a server"
}

# ---- usage ---------------------------------------------------------------------------
"$BIN" --help | grep -q 'skiff-perf client' || fail "--help"
"$BIN" --help | grep -q 'corrupt-every' || fail "--help must document --corrupt-every"
pass "--help"

expect_usage() {
	local rc=0
	timeout 10 "$BIN" "$@" >"$TMP/usage.out" 2>"$TMP/usage.err" || rc=$?
	[[ $rc -eq 64 ]] || fail "'$*': exit $rc, want 64"
	[[ -s $TMP/usage.err && ! -s $TMP/usage.out ]] || fail "'$*': message belongs on stderr"
}
expect_usage
expect_usage bogus
expect_usage client --bogus
expect_usage client --host 127.0.0.1 --test nope
expect_usage client --test tcp_rr
expect_usage client --host 127.0.0.1
expect_usage client --host 127.0.0.1 --test tcp_rr --size 0
expect_usage client --host 127.0.0.1 --test tcp_rr --size 2000000
expect_usage client --host 127.0.0.1 --test udp_rr --size 65508
expect_usage client --host 127.0.0.1 --test tcp_rr --duration -1
expect_usage client --host 127.0.0.1 --test tcp_rr --duration abc
expect_usage client --host 127.0.0.1 --test tcp_rr --count 0
expect_usage client --host 127.0.0.1 --test tcp_rr --count
expect_usage client --host 127.0.0.1 --test tcp_rr --connections 4
expect_usage client --host 127.0.0.1 --test tcp_crr --new-conn
expect_usage client --host 127.0.0.1 --test connect --size 10
expect_usage client --host 127.0.0.1 --test memcached --connections 0
expect_usage client --host 127.0.0.1 --test tcp_rr --port 70000
expect_usage client --host 127.0.0.1 --test tcp_rr extra
expect_usage server --port 65535
expect_usage server --bogus
expect_usage server --corrupt-every x
grep -q 'unknown --test' <(timeout 10 "$BIN" client --host 127.0.0.1 --test nope 2>&1) ||
	fail "unknown --test needs a clear message"
pass "bad usage exits 64"

# ---- unreachable server ----------------------------------------------------------------
closed=$(free_port $$)
for t in tcp_rr udp_rr tcp_crr connect memcached; do
	run_client --host 127.0.0.1 --port "$closed" --test "$t" --count 10
	[[ $RC -eq 1 ]] || fail "$t against a closed port: exit $RC, want 1"
	[[ -z $OUT ]] || fail "$t against a closed port printed a result"
done
pass "connection refused exits 1 (all tests)"

# ---- a correct server ------------------------------------------------------------------
start_server
P=$SERVER_PORT
expect_ok tcp_rr "" -- --port "$P" --duration 0.5
expect_ok tcp_rr 200 -- --port "$P" --count 200 --size 4096
expect_ok tcp_rr 20 -- --port "$P" --count 20 --size 1048576
expect_ok tcp_rr "" -- --port "$P" --warmup 0.2 --duration 0.3
expect_ok tcp_rr 100 -- --port "$P" --duration 10 --count 100
expect_ok udp_rr "" -- --port "$P" --duration 0.5
expect_ok udp_rr 200 -- --port "$P" --count 200 --size 1400
expect_ok udp_rr 50 -- --port "$P" --count 50 --size 65507
expect_ok tcp_crr "" -- --port "$P" --duration 0.5
expect_ok tcp_crr 200 -- --port "$P" --count 200 --size 3000
expect_ok connect 200 -- --port "$P" --count 200
expect_ok connect "" -- --port "$P" --duration 0.3

# Several clients at once against the same server.
for t in tcp_rr udp_rr tcp_crr connect tcp_rr; do
	timeout 60 "$BIN" client --host 127.0.0.1 --port "$P" --test "$t" --duration 0.5 \
		>"$TMP/par-$t-$RANDOM.out" 2>>"$TMP/client.err" &
	PIDS+=("$!")
	par_pids+=("$!")
done
for pid in "${par_pids[@]}"; do
	wait "$pid" || fail "a concurrent client failed"
done
for f in "$TMP"/par-*.out; do
	t=$(basename "$f" | cut -d- -f2)
	python3 "$TMP/check.py" ok "$t" "$(cat "$f")" || fail "concurrent $t: bad result"
done
pass "5 concurrent clients"

# ---- udp_rr with losses and late replies -------------------------------------------------
# Fake server: of every 10 datagrams it drops one and answers one only after 120 ms,
# i.e. after the client gave up on it (50 ms): that late reply must be discarded.
cat >"$TMP/lossy.py" <<'EOF'
import heapq, select, socket, sys, time

s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
pending, k = [], 0
while True:
    timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
    readable, _, _ = select.select([s], [], [], timeout)
    now = time.monotonic()
    while pending and pending[0][0] <= now:
        _, _, data, addr = heapq.heappop(pending)
        s.sendto(data, addr)
    if not readable:
        continue
    data, addr = s.recvfrom(65536)
    k += 1
    reply = bytes(b ^ 0xA5 for b in data)
    if k % 10 == 3:
        continue
    if k % 10 == 6:
        heapq.heappush(pending, (now + 0.12, k, reply, addr))
        continue
    s.sendto(reply, addr)
EOF
python3 "$TMP/lossy.py" >"$TMP/lossy.port" &
PIDS+=("$!")
for _ in $(seq 100); do [[ -s $TMP/lossy.port ]] && break; sleep 0.05; done
LP=$(cat "$TMP/lossy.port")
for size in 1 64; do
	run_client --host 127.0.0.1 --port "$LP" --test udp_rr --count 200 --size "$size"
	[[ $RC -eq 0 ]] || fail "udp_rr --size $size with losses: exit $RC, want 0; $OUT"
	python3 "$TMP/check.py" lossy udp_rr "$OUT" 200 || fail "udp_rr with losses: bad result"
done
pass "udp_rr counts lost datagrams and discards late replies"

# ---- a corrupting server: errors must be detected ---------------------------------------
start_server --corrupt-every 50
CP=$SERVER_PORT
for t in tcp_rr udp_rr tcp_crr; do
	for size in 1 1000; do
		run_client --host 127.0.0.1 --port "$CP" --test "$t" --count 200 --size "$size"
		[[ $RC -eq 2 ]] || fail "$t --size $size against a corrupting server: exit $RC, want 2"
		python3 "$TMP/check.py" errors "$t" "$OUT" || fail "$t: corrupt result"
		grep -q 'byte' "$TMP/client.err" || fail "$t: stderr should say which byte"
	done
done
pass "corrupted responses are detected (tcp_rr, udp_rr, tcp_crr: exit 2)"

# ---- memcached client verifies values -------------------------------------------------------
# Fake memcached that stores faithfully but flips a byte of every 50th GET value.
cat >"$TMP/fakemc.py" <<'EOF'
import socketserver, threading

store, lock, gets = {}, threading.Lock(), [0]

class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            cmd = line.split()
            if cmd[0] == b"set":
                data = self.rfile.read(int(cmd[4]) + 2)[:-2]
                with lock:
                    store[cmd[1]] = (cmd[2], data)
                self.wfile.write(b"STORED\r\n")
            elif cmd[0] == b"get":
                with lock:
                    v = store.get(cmd[1])
                    gets[0] += 1
                    corrupt = gets[0] % 50 == 0
                if not v:
                    self.wfile.write(b"END\r\n")
                    continue
                data = bytearray(v[1])
                if corrupt:
                    data[len(data) // 2] ^= 1
                self.wfile.write(b"VALUE %s %s %d\r\n%s\r\nEND\r\n"
                                 % (cmd[1], v[0], len(data), data))
            else:  # quit
                return

class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True

s = Server(("127.0.0.1", 0), Handler)
print(s.server_address[1], flush=True)
s.serve_forever()
EOF
python3 "$TMP/fakemc.py" >"$TMP/fakemc.port" &
PIDS+=("$!")
for _ in $(seq 100); do [[ -s $TMP/fakemc.port ]] && break; sleep 0.05; done
FP=$(cat "$TMP/fakemc.port")
for mode in --connections=2 --new-conn; do
	run_client --host 127.0.0.1 --port "$FP" --test memcached --count 500 "$mode"
	[[ $RC -eq 2 ]] || fail "memcached $mode with corrupted values: exit $RC, want 2"
	python3 "$TMP/check.py" errors memcached "$OUT" || fail "memcached: corrupt result"
	grep -q 'value byte' "$TMP/client.err" || fail "memcached: stderr should say which byte"
done
pass "corrupted memcached values are detected (exit 2)"

# ---- server exits 0 on SIGTERM ------------------------------------------------------------
kill -TERM "$SERVER_PID"
rc=0
wait "$SERVER_PID" || rc=$?
[[ $rc -eq 0 ]] || fail "server exit $rc on SIGTERM, want 0"
pass "server exits 0 on SIGTERM"

# ---- memcached ------------------------------------------------------------------------------
if command -v memcached >/dev/null; then
	MP=""
	for try in 1 2 3 4 5; do
		port=$(free_port $(($$ * 3 + try * 541 + RANDOM)))
		memcached -p "$port" -U 0 -l 127.0.0.1 -u root -m 64 2>"$TMP/memcached.log" &
		pid=$!
		PIDS+=("$pid")
		for _ in $(seq 100); do
			if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
				MP=$port
				break
			fi
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.05
		done
		[[ -n $MP ]] && break
	done
	[[ -n $MP ]] || fail "cannot start memcached"
	expect_ok memcached "" -- --port "$MP" --duration 0.5 --connections 4
	expect_ok memcached "" -- --port "$MP" --duration 0.5
	expect_ok memcached 300 -- --port "$MP" --count 300 --connections 4 --new-conn
	expect_ok memcached "" -- --port "$MP" --duration 0.5 --warmup 0.2 --new-conn
else
	echo "SKIP memcached tests: memcached is not installed"
fi

echo "PASS: $PASSED checks"
