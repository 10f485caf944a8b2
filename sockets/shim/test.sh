#!/bin/bash
# End-to-end test of libskiff.so + skiff-broker WITHOUT the eBPF hooks.
#
# Topology (all created here, removed by the trap):
#   skfshim-h  "host" netns     10.98.0.1/24  --veth--  10.98.0.2/24  skfshim-c "container" netns
#   skfshim-x  "elsewhere"      10.98.9.1/24  --veth--  10.98.9.2/24  skfshim-c
#              + 10.99.0.1 on lo (c routes 10.99.0.0/24 via 10.98.9.1)
# The broker (in h, listening in c) is told the cluster is 10.98.0.0/16 and the
# container IP is 10.98.0.2.  So from c, with the shim:
#   10.98.0.1  in CIDR, reachable from h  -> host socket (fast path)
#   10.98.9.1  in CIDR, NOT reachable from h (ENETUNREACH) -> "kernel refused" fallback
#   10.99.0.1  outside CIDR -> destination fallback (container socket)
# Without hooks a host socket reaching 10.98.0.1 is seen by the server with
# source 10.98.0.1 (h's own address), a container socket with 10.98.0.2.
set -u
cd "$(dirname "$0")"
DIR=$(pwd)
SHIM=$DIR/libskiff.so
SKB=$DIR/../broker/skiff-broker   # the broker (built in ../broker)
H=skfshim-h C=skfshim-c X=skfshim-x
PY=/usr/bin/python3
[ -x $PY ] || PY=python3
TMP=$(mktemp -d /tmp/skfshim.XXXXXX)
PIDS=()
FAILS=0
CG=""

cleanup() {
	local p ns
	for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
	# anything still running inside the namespaces created here was started here
	for ns in $H $C $X; do for p in $(ip netns pids $ns 2>/dev/null); do kill "$p" 2>/dev/null; done; done
	for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
	ip netns del $H 2>/dev/null; ip netns del $C 2>/dev/null; ip netns del $X 2>/dev/null
	[ -n "$CG" ] && rmdir "$CG" 2>/dev/null
	[ -n "${KEEP_TMP:-}" ] && cp -r "$TMP" /tmp/skfshim-kept; rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ok()   { echo "ok   $*"; }
fail() { echo "FAIL $*"; FAILS=$((FAILS + 1)); }
check() { local name=$1; shift; if "$@" >"$TMP/out" 2>&1; then ok "$name"; else fail "$name"; sed 's/^/     | /' "$TMP/out" | tail -20; fi; }
inh() { ip netns exec $H "$@"; }
inc() { ip netns exec $C "$@"; }
inx() { ip netns exec $X "$@"; }
shim() { ip netns exec $C env LD_PRELOAD=$SHIM "$@"; }
# for background jobs use these arrays, not the functions: "fn &" would fork a
# subshell and $! would not be the PID of the program
INH=(ip netns exec $H) INX=(ip netns exec $X) SHIMC=(ip netns exec $C env LD_PRELOAD=$SHIM)
# expect the sockcheck output in $TMP/out to have no FAIL and at least one ok
sc_ok() { "$@" >"$TMP/out" 2>&1; local rc=$?; grep -q '^ok' "$TMP/out" && ! grep -q '^FAIL' "$TMP/out" && [ $rc = 0 ]; }
stat_slot() { $PY -c "import struct,sys; print(struct.unpack('9Q', open(sys.argv[1],'rb').read(72))[int(sys.argv[2])])" "$1" "$2"; }
wait_port() { # ns ip:port
	for _ in $(seq 100); do ip netns exec "$1" ss -ltnH "src $2" 2>/dev/null | grep -q LISTEN && return 0; sleep 0.05; done; return 1
}
start_broker() { # extra args
	nsenter --net=/run/netns/$H $SKB --netns /run/netns/$C --cidr 10.98.0.0/16 --ip 10.98.0.2 --stats "$TMP/stats" "$@" 2>>"$TMP/broker.log" &
	BROKER=$!; PIDS+=($BROKER)
	for _ in $(seq 100); do
		[ -s "$TMP/stats" ] && [ "$(stat_slot "$TMP/stats" 0 2>/dev/null)" = $((0x354534b53)) ] && return 0
		sleep 0.05
	done
	return 1
}
T0=$(date +%s)

[ "$(id -u)" = 0 ] || { echo "test.sh must run as root"; exit 1; }
for f in libskiff.so $SKB sockcheck failsock.so eagain.so; do [ -x $f ] || [ -f $f ] || { echo "build first (make)"; exit 1; }; done
for ns in $H $C $X; do ip netns del $ns 2>/dev/null; done

# ---------------- topology ----------------
set -e
ip netns add $H; ip netns add $C; ip netns add $X
ip link add skfh0 netns $H type veth peer name skfc0 netns $C
ip link add skfx0 netns $X type veth peer name skfc1 netns $C
inh ip addr add 10.98.0.1/24 dev skfh0; inh ip link set skfh0 up; inh ip link set lo up
inc ip addr add 10.98.0.2/24 dev skfc0; inc ip link set skfc0 up; inc ip link set lo up
inc ip addr add 10.98.9.2/24 dev skfc1; inc ip link set skfc1 up
inc ip route add 10.99.0.0/24 via 10.98.9.1
inx ip addr add 10.98.9.1/24 dev skfx0; inx ip link set skfx0 up; inx ip link set lo up
inx ip addr add 10.99.0.1/32 dev lo
set +e

# ---------------- broker flags ----------------
bad_flags() {
	! $SKB --netns /run/netns/$C --cidr 10.98.0.0/16 --ip 10.98.0.2 --bogus 2>"$TMP/e" && grep -q "unknown flag --bogus" "$TMP/e" || return 1
	! $SKB --netns /run/netns/$C --cidr 10.98.0.0/33 --ip 10.98.0.2 2>"$TMP/e" && grep -q "bad --cidr" "$TMP/e" || return 1
	! $SKB --netns /run/netns/$C --cidr 10.98.0.0/16 --ip 10.97.0.2 2>"$TMP/e" && grep -q "not inside" "$TMP/e" || return 1
	! $SKB --netns /run/netns/$C --cidr 10.98.0.0/16 --ip x 2>"$TMP/e" && grep -q "bad --ip" "$TMP/e" || return 1
	! $SKB --cidr 10.98.0.0/16 --ip 10.98.0.2 2>"$TMP/e" && grep -q "want one of --netns and --listen-fd" "$TMP/e" || return 1
	! $SKB --netns /run/netns/$C --listen-fd 3 --cidr 10.98.0.0/16 --ip 10.98.0.2 2>"$TMP/e" && grep -q "want one of" "$TMP/e" || return 1
	! $SKB --listen-fd 3 --cidr 10.98.0.0/16 --ip 10.98.0.2 3</dev/null 2>"$TMP/e" && grep -q -- "--listen-fd 3: " "$TMP/e" || return 1
	! $SKB --netns /run/netns/nonexistent-skf --cidr 10.98.0.0/16 --ip 10.98.0.2 2>"$TMP/e" && grep -q "open netns" "$TMP/e" || return 1
	! $SKB --netns /etc/hostname --cidr 10.98.0.0/16 --ip 10.98.0.2 2>"$TMP/e" && grep -q "setns" "$TMP/e"
}
check broker-bad-flags bad_flags

# ---------------- servers ----------------
"${INH[@]}" ./sockcheck server 10.98.0.1 7001 --expect-net 10.98.0.0/24 >"$TMP/srv_h.log" 2>&1 & PIDS+=($!)
"${INX[@]}" ./sockcheck server 10.98.9.1 7002 >"$TMP/srv_x.log" 2>&1 & PIDS+=($!)
"${INX[@]}" ./sockcheck server 10.99.0.1 7003 >"$TMP/srv_x2.log" 2>&1 & PIDS+=($!)
mkdir -p "$TMP/www"; echo skiff-hello >"$TMP/www/index.html"
"${INH[@]}" $PY -m http.server 8080 --bind 10.98.0.1 --directory "$TMP/www" >"$TMP/http.log" 2>&1 & PIDS+=($!)
wait_port $H 10.98.0.1:7001 && wait_port $X 10.98.9.1:7002 && wait_port $X 10.99.0.1:7003 && wait_port $H 10.98.0.1:8080 \
	|| { fail "servers did not start"; exit 1; }

# cgroup v2 (optional): broker moves itself into --cgroup
CG2=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
CGARG=()
if [ -n "$CG2" ] && mkdir "$CG2/skfshim-test" 2>/dev/null; then CG=$CG2/skfshim-test; CGARG=(--cgroup "$CG"); fi
start_broker --transparent "${CGARG[@]}" || { fail "broker did not start"; cat "$TMP/broker.log"; exit 1; }
if [ -n "$CG" ]; then
	check broker-cgroup grep -qx "0::/skfshim-test" /proc/$BROKER/cgroup
fi
check broker-abstract-in-container sh -c "ip netns exec $C ss -xlH | grep -q '@skiff-broker' && ! ip netns exec $H ss -xlH | grep -q '@skiff-broker'"

# ---------------- baseline (no shim): container sockets ----------------
check baseline-no-shim sc_ok inc ./sockcheck client 10.98.0.1 7001 --expect-net 10.98.0.0/24 --server-peer 10.98.0.2 --host no

# ---------------- fast path: host sockets ----------------
check shim-sockcheck-host sc_ok shim ./sockcheck client 10.98.0.1 7001 --expect-net 10.98.0.0/24 --server-peer 10.98.0.1 --host yes
grep -q '^FAIL' "$TMP/srv_h.log" && fail "server-side checks (accept4 flags)" || ok "server-side checks (accept4 flags)"

# the replaced socket is visible in the HOST netns (ss in h), not in c
"${SHIMC[@]}" $PY -c '
import socket, time
s = socket.create_connection(("10.98.0.1", 7001)); s.recv(64)
print(s.getsockname()[1], flush=True); time.sleep(1.5)' >"$TMP/hs" 2>&1 & HP=$!; PIDS+=($HP)
sleep 0.6
ss_host() {
	local p; p=$(head -1 "$TMP/hs"); echo "client port $p"; inh ss -tnH state established
	[ -n "$p" ] && inh ss -tnH state established "( sport = :$p and dport = :7001 )" | grep -q . &&
	! inc ss -tnH state established "( dport = :7001 )" | grep -q .
}
check ss-shows-host-socket ss_host
wait $HP 2>/dev/null

# curl / wget / python urllib through the shim: http.server logs the client address
http_checks() {
	shim curl -sf http://10.98.0.1:8080/index.html | grep -q skiff-hello || { echo curl failed; return 1; }
	shim wget -q -O - http://10.98.0.1:8080/index.html | grep -q skiff-hello || { echo wget failed; return 1; }
	shim $PY -c 'import urllib.request; assert b"skiff-hello" in urllib.request.urlopen("http://10.98.0.1:8080/index.html").read()' || return 1
	cat "$TMP/http.log"
	[ "$(grep -c '^10.98.0.1 .*GET /index.html' "$TMP/http.log")" = 3 ] && ! grep -q '^10.98.0.2 ' "$TMP/http.log"
}
check curl-wget-urllib-host http_checks

# a server under the shim: bind(0.0.0.0:7200) lands in h (without hooks: not rewritten), accept4 flags etc.
"${SHIMC[@]}" ./sockcheck server 0.0.0.0 7200 --count 8 >"$TMP/srv_c.log" 2>&1 & SP=$!; PIDS+=($SP)
server_shim() {
	wait_port $H 0.0.0.0:7200 || { echo "no listener in h"; return 1; }
	inc ss -ltnH | grep -q ':7200 ' && { echo "listener in c"; return 1; }
	sc_ok inh ./sockcheck client 10.98.0.1 7200 || { cat "$TMP/out"; return 1; }
	wait $SP; local rc=$?; cat "$TMP/srv_c.log"; [ $rc = 0 ] && grep -q '^ok   accept4-flags' "$TMP/srv_c.log"
}
check shim-server-listener-in-host server_shim

# bind rules: listen() without bind -> explicit bind 0.0.0.0:0 on the host socket;
# bind(container ip) -> EADDRNOTAVAIL in h -> container socket; bind(127.0.0.1) -> container socket;
# a host listener bound to lo when listen() returns (how sockops marks one it could not publish;
# here the app's own option, without hooks) -> container socket, the option replayed
"${SHIMC[@]}" $PY -c '
import socket, time
a = socket.socket(); a.listen()                                   # fast path, implicit bind
assert a.getsockopt(socket.SOL_IP, 19) == 1, "listener not IP_TRANSPARENT"
assert socket.socket().getsockopt(socket.SOL_IP, 19) == 0, "pooled socket IP_TRANSPARENT"
b = socket.socket(); b.bind(("10.98.0.2", 7301)); b.listen()      # refused in h -> swap
c = socket.socket(); c.bind(("127.0.0.1", 7302)); c.listen()      # not overlay -> swap
d = socket.socket(); d.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
d.bind(("0.0.0.0", 7303)); d.listen()                             # on lo after listen -> swap
print(a.getsockname()[1], flush=True); time.sleep(2)' >"$TMP/lst" 2>&1 & LP=$!; PIDS+=($LP)
sleep 0.7
bind_rules() {
	local port; port=$(head -1 "$TMP/lst"); cat "$TMP/lst"
	[ -n "$port" ] && inh ss -ltnH | grep -q "0.0.0.0:$port " || { echo "implicit listener not in h"; return 1; }
	inc ss -ltnH | grep -q "0.0.0.0:$port " && { echo "implicit listener in c"; return 1; }
	inc ss -ltnH | grep -q "10.98.0.2:7301 " || { echo "10.98.0.2:7301 not in c"; return 1; }
	inc ss -ltnH | grep -q "127.0.0.1:7302 " || { echo "127.0.0.1:7302 not in c"; return 1; }
	inc ss -ltnH | grep -q "0.0.0.0%lo:7303 " || { echo "0.0.0.0%lo:7303 not in c"; return 1; }
	inh ss -ltnH | grep -q ":7303 " && { echo "listener on lo in h"; return 1; }
	return 0
}
check bind-listen-rules bind_rules
wait $LP 2>/dev/null

# the broker makes only host TCP sockets transparent, and drops a client that passes fds with other requests
broker_validates() {
	inc $PY - <<'EOF2'
import socket, struct, array
def conn():
    b = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); b.connect("\0skiff-broker"); assert len(b.recv(64)) == 32; return b
def send(b, op, fd):
    b.sendmsg([struct.pack("=BBHII", ord(op), 1 if op == "S" else 0, 0, 0, 0)],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
u = socket.socket()                            # a container-netns TCP socket
b = conn(); send(b, "T", u.fileno())
assert struct.unpack("=I", b.recv(4))[0] == 0, "container socket made transparent"
assert u.getsockopt(socket.SOL_IP, 19) == 0
# host sockets: only a bound one that is not connected (the shim's listener
# before listen()); closing a connected one could block the broker (linger)
def host_socket(b):
    b.send(struct.pack("=BBHII", ord("S"), 1, 0, 0, 0))
    msg, fds, _, _ = socket.recv_fds(b, 4, 1)
    return socket.socket(fileno=fds[0])
b = conn()
fresh, connected, bound = host_socket(b), host_socket(b), host_socket(b)
connected.connect(("10.98.0.1", 7001))
bound.bind(("0.0.0.0", 0))
for sk, want in ((fresh, 0), (connected, 0), (bound, 1)):
    send(b, "T", sk.fileno())
    got = struct.unpack("=I", b.recv(4))[0]
    assert got == want and sk.getsockopt(socket.SOL_IP, 19) == want, (sk, got)
b = conn(); send(b, "S", u.fileno()); assert b.recv(64) == b"", "client passing fds with 'S' not dropped"
print("broker validates ok")
EOF2
	for _ in $(seq 40); do [ "$(stat_slot "$TMP/stats" 6)" = 1 ] && break; sleep 0.05; done
	grep "fds where none belong\|not made transparent" "$TMP/broker.log"; [ "$(stat_slot "$TMP/stats" 6)" = 1 ]
}
check broker-validates-passed-fds broker_validates

# a client that asks and never reads holds at most 2 replies per connection
# (the sockets in them are alive and count against no limit of its own);
# once it reads, it gets the rest
hoarder() {
	inc $PY - <<'EOF2'
import fcntl, os, socket, struct, termios, time
conns = []
for _ in range(3):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect("\0skiff-broker")
    assert len(s.recv(64)) == 32               # hello
    for _ in range(40):
        s.send(struct.pack("=BBHII", ord("S"), 64, 0, 0, 0))
    conns.append(s)
time.sleep(0.5)
def queued(s):                                 # replies waiting, 4 bytes each
    return struct.unpack("i", fcntl.ioctl(s, termios.FIONREAD, b"\0" * 4))[0] // 4
held = [queued(s) for s in conns]
assert all(1 <= q <= 2 for q in held), "replies queued unread: %s" % held
def drain(s):
    got, deadline = 0, time.time() + 10
    s.settimeout(1)
    while got < 40 and time.time() < deadline:
        msg, fds, _, _ = socket.recv_fds(s, 4, 64)
        assert 0 < len(fds) <= 32 and struct.unpack("=I", msg)[0] == len(fds), (msg, len(fds))
        for f in fds: os.close(f)
        got += 1
    return got
got = [drain(s) for s in conns]
assert got == [40, 40, 40], "replies once read: %s" % got
print("hoarder ok", held)
EOF2
}
check broker-caps-unread-replies hoarder

# ---------------- fallbacks ----------------
check fallback-dest-outside-cidr sc_ok shim ./sockcheck client 10.99.0.1 7003 --server-peer 10.98.9.2 --host no
check fallback-kernel-refused sc_ok shim ./sockcheck client 10.98.9.1 7002 --server-peer 10.98.9.2 --host no

# option replay + fd number/flags preserved across the swap; non-TCP sockets untouched
replay() {
	shim $PY - <<'EOF'
import socket, fcntl, os
def ck(s): return s.getsockopt(socket.SOL_SOCKET, 71, 8)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); cont = ck(u)
assert ck(socket.socket(socket.AF_INET6, socket.SOCK_STREAM)) == cont, "AF_INET6 replaced"
assert ck(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) == cont, "AF_UNIX replaced"
s = socket.socket(); s.setblocking(False)
assert ck(s) != cont, "not a host socket"
fd = s.fileno()
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")
err = s.connect_ex(("10.99.0.1", 7003))
assert err == 115, "want EINPROGRESS, got %d" % err      # non-blocking semantics kept
assert s.fileno() == fd and ck(s) == cont, "not swapped to container socket"
assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"reno"
assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
s.setblocking(True); assert s.recv(4) == b"SKCK"
print("replayed ok")
EOF
}
check fallback-replays-options replay

# ---------------- the broker's address ----------------
# skiffd binds it and passes the listener (--listen-fd): the broker serves it
passed_listener() {
	ip netns exec $C $PY -c '
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.bind("\0skfpassed"); s.listen(16)
os.dup2(s.fileno(), 3)
os.set_inheritable(3, True)  # when the socket already was fd 3, dup2 did nothing and it is close-on-exec
os.execvp("nsenter", ["nsenter", "--net=/run/netns/" + sys.argv[1], sys.argv[3], "--listen-fd", "3",
    "--cidr", "10.98.0.0/16", "--ip", "10.98.0.2", "--name", "skfpassed", "--stats", sys.argv[2]])' $H "$TMP/stats-passed" "$SKB" 2>>"$TMP/broker.log" &
	local bp=$!; PIDS+=($bp)
	for _ in $(seq 100); do [ "$(stat_slot "$TMP/stats-passed" 0 2>/dev/null)" = $((0x354534b53)) ] && break; sleep 0.05; done
	sc_ok ip netns exec $C env LD_PRELOAD=$SHIM SKIFF_BROKER=skfpassed ./sockcheck client 10.98.0.1 7001 --server-peer 10.98.0.1 --host yes
	local rc=$?
	kill $bp; wait $bp
	return $rc
}
check broker-serves-passed-listener passed_listener

# --refuse-privileged: a client whose bounding set holds CAP_NET_ADMIN (as
# root under ip netns exec does) gets no host socket and falls back; from
# then on the broker refuses every client, unprivileged ones too
refuse_privileged() {
	nsenter --net=/run/netns/$H $SKB --netns /run/netns/$C --cidr 10.98.0.0/16 --ip 10.98.0.2 \
		--name skfpriv --stats "$TMP/stats-priv" --refuse-privileged 2>>"$TMP/broker.log" &
	local bp=$!; PIDS+=($bp)
	for _ in $(seq 100); do [ "$(stat_slot "$TMP/stats-priv" 0 2>/dev/null)" = $((0x354534b53)) ] && break; sleep 0.05; done
	local unpriv=(setpriv --bounding-set -net_admin,-sys_admin)
	local rc=0
	sc_ok ip netns exec $C "${unpriv[@]}" env LD_PRELOAD=$SHIM SKIFF_BROKER=skfpriv ./sockcheck client 10.98.0.1 7001 --server-peer 10.98.0.1 --host yes || { echo "unprivileged: no host socket"; rc=1; }
	[ "$(stat_slot "$TMP/stats-priv" 8)" = 0 ] || { echo "refused an unprivileged client"; rc=1; }
	sc_ok ip netns exec $C env LD_PRELOAD=$SHIM SKIFF_BROKER=skfpriv ./sockcheck client 10.98.0.1 7001 --server-peer 10.98.0.2 --host no || { echo "privileged: got a host socket"; rc=1; }
	[ "$(stat_slot "$TMP/stats-priv" 8)" != 0 ] || { echo "privileged pid not recorded"; rc=1; }
	sleep 1.1   # the shim's retry back-off
	sc_ok ip netns exec $C "${unpriv[@]}" env LD_PRELOAD=$SHIM SKIFF_BROKER=skfpriv ./sockcheck client 10.98.0.1 7001 --server-peer 10.98.0.2 --host no || { echo "unprivileged after privileged: got a host socket"; rc=1; }
	grep "skfpriv" "$TMP/broker.log" | grep -q "CAP_NET_ADMIN or CAP_SYS_ADMIN" || { echo "no log line"; rc=1; }
	kill $bp; wait $bp
	return $rc
}
check broker-refuses-privileged refuse_privileged

# an unprivileged process that bound the name first is no broker: the shim
# closes the connection before the hello (SO_PEERCRED: not uid 0) and falls
# back; the impostor never gets a request
impostor() {
	ip netns exec $C setpriv --reuid=65534 --regid=65534 --clear-groups $PY -c '
import socket, sys, struct
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.bind("\0skfimpostor"); s.listen(16)
print("bound", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(1)
    try:
        c.send(struct.pack("=IIIB3xIIQ", 0x31464b53, 4, 0x0000620a, 16, 0x0200620a, 0, 1))
        m = c.recv(64)
    except OSError:
        m = b""
    print("request" if m else "no request", flush=True)' >"$TMP/impostor" 2>&1 &
	local ip=$!; PIDS+=($ip)
	for _ in $(seq 100); do grep -q bound "$TMP/impostor" && break; sleep 0.05; done
	sc_ok ip netns exec $C env LD_PRELOAD=$SHIM SKIFF_BROKER=skfimpostor ./sockcheck client 10.98.0.1 7001 --server-peer 10.98.0.2 --host no
	local rc=$?
	sleep 1.2
	kill $ip; wait $ip 2>/dev/null
	cat "$TMP/impostor"
	[ $rc = 0 ] && grep -q "no request" "$TMP/impostor" && ! grep -q "^request" "$TMP/impostor"
}
check shim-refuses-unprivileged-impostor impostor

# ---------------- opt-out, fork+exec, threads, many connections ----------------
ct_before=$(stat_slot "$TMP/stats" 4)
check opt-out-SKIFF_SOCKETS=off sc_ok ip netns exec $C env LD_PRELOAD=$SHIM SKIFF_SOCKETS=off ./sockcheck client 10.98.0.1 7001 --server-peer 10.98.0.2 --host no
check opt-out-no-broker-contact test "$(stat_slot "$TMP/stats" 4)" = "$ct_before"
# a listen() that failed asks the broker for IP_TRANSPARENT once: the process's
# connection, one 'T' per listener
relisten() {
	local before=$(stat_slot "$TMP/stats" 4)
	sc_ok shim ./sockcheck relisten 10.98.0.1 7071 5 || { cat "$TMP/out"; return 1; }
	local n=$(( $(stat_slot "$TMP/stats" 4) - before ))
	echo "broker connections: $n (want 3)"; [ "$n" = 3 ]
}
check failed-listen-asks-transparent-once relisten
check fork-exec-shell sc_ok shim sh -c "./sockcheck client 10.98.0.1 7001 --quick && exec ./sockcheck client 10.98.0.1 7001 --server-peer 10.98.0.1 --host yes"
noleak_exec() {
	shim $PY -c '
import socket, os
s = socket.create_connection(("10.98.0.1", 7001))
os.execv("/bin/sh", ["sh", "-c", "ls -l /proc/self/fd"])' >"$TMP/fds"
	cat "$TMP/fds"; grep -q /proc/ "$TMP/fds" && ! grep -q "socket:" "$TMP/fds"
}
check exec-no-fd-leak noleak_exec
# a forked child closes its copies of the pool: they would keep the parent's later connections open
fork_pool() {
	shim $PY - <<'EOF2'
import os, socket
high = lambda: [int(n) for n in os.listdir("/proc/self/fd") if int(n) >= 600]
s = socket.socket()                           # the first batch: the rest waits in the pool
assert len(high()) > 8, high()                # broker connection + pool
pid = os.fork()
if pid == 0:
    os._exit(1 if high() else 0)
assert os.waitpid(pid, 0)[1] == 0, "child kept pooled sockets"
t = socket.socket(); assert t.fileno() < 600 and len(high()) > 8, (t.fileno(), high())
print("fork pool ok")
EOF2
}
check fork-child-closes-pool fork_pool

# under a small fd limit the batch is smaller: it lands in the app's fd table before it moves up
small_fd_limit() {
	inc prlimit --nofile=32 env LD_PRELOAD=$SHIM $PY - <<'EOF2'
import os, socket
def peer(s):
    return s.recv(64).split(b"=")[1].split(b":")[0].decode()
s = socket.create_connection(("10.98.0.1", 7001)); assert peer(s) == "10.98.0.1", "not replaced under a 32-fd limit"
n = 0
try:
    while True:
        os.open("/dev/null", os.O_RDONLY); n += 1
except OSError:
    pass
print("files the app could still open:", n)
assert n >= 16, n
EOF2
}
check small-fd-limit-small-batch small_fd_limit

# out of fds, some of them the pool's: socket() and a fallback's swap (which
# needs one more fd) still succeed, as they would without the shim
out_of_fds_app() {
	inc prlimit --nofile=64 env LD_PRELOAD=$SHIM $PY - <<'EOF2'
import errno, os, socket
def fill():
    fds = []
    while True:
        try:
            fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as e:
            assert e.errno == errno.EMFILE, e
            return fds
socket.socket().close()                        # the pool fills
fresh = socket.socket()                        # a fresh host socket
fds = fill()
fresh.connect(("10.99.0.1", 7003))             # outside the cluster: the swap needs an fd
fresh.close(); os.close(fds.pop())
fds += fill()
s = socket.socket()                            # the pool's fds go back to the app
print("out of fds ok")
EOF2
}
check out-of-fds-socket-and-swap out_of_fds_app
check pool-batches-between-app-files sc_ok shim ./sockcheck holes 10.98.0.1 7001
check threads-16x40 sc_ok shim ./sockcheck threads 10.98.0.1 7001 16 40
check fork-with-signals-no-deadlock sc_ok timeout 60 ip netns exec $C env LD_PRELOAD=$SHIM ./sockcheck forksig 10.98.0.1 7001 3000
check signal-handler-dup-close-no-malloc sc_ok timeout 60 ip netns exec $C env LD_PRELOAD=$SHIM ./sockcheck sigmalloc 10.98.0.1 7001 3000000
check pool-numbers-keep-app-files-and-locks sc_ok timeout 30 ip netns exec $C env LD_PRELOAD=$SHIM ./sockcheck locks 10.98.0.1 7001
check loop-2000-no-fd-leak sc_ok shim ./sockcheck loop 10.98.0.1 7001 2000
grep '^info' "$TMP/out"

# a broker that sends more sockets than asked for: the shim closes all it got
# and falls back (under a 128-fd limit the batch is 31, and the message has
# room for 32)
too_many_fds() {
	inc prlimit --nofile=128 env LD_PRELOAD=$SHIM SKIFF_BROKER=skfshim-fake $PY - <<'EOF2'
import array, os, socket, struct, threading
ls = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); ls.bind("\0skfshim-fake"); ls.listen(1)
def fake():
    c, _ = ls.accept()
    c.send(struct.pack("=IIIB3xIIQ", 0x31464b53, 4, socket.htonl(0x0a620000), 16, socket.htonl(0x0a620002), 0, 0))
    op, n = struct.unpack("=BB10x", c.recv(12))
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(n + 1)]
    c.sendmsg([struct.pack("=I", n + 1)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    for f in fds: os.close(f)
    closed.set()
    c.recv(12)  # until the shim hangs up
closed = threading.Event()
threading.Thread(target=fake, daemon=True).start()
def devnull():
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try: n += os.readlink("/proc/self/fd/" + f) == "/dev/null"
        except FileNotFoundError: pass   # listdir's own
    return n
before = devnull()                             # (inherited ones)
s = socket.socket()                            # falls back: a container socket
assert s.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) == socket.AF_INET
assert closed.wait(5)
assert devnull() == before, "%d received fds left open" % (devnull() - before)
print("too many fds ok")
EOF2
}
check broker-sends-too-many-fds too_many_fds

# a broker that accepts nothing (stopped, hung, out of fds) with a full
# backlog: socket() falls back at once instead of waiting for ever
stuck_broker() {
	inc timeout 10 env LD_PRELOAD=$SHIM SKIFF_BROKER=skfshim-stuck $PY - <<'EOF2'
import socket, time
ls = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); ls.bind("\0skfshim-stuck"); ls.listen(0)
queued = []
while True:                                    # fill its backlog
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); c.setblocking(False)
    try:
        c.connect("\0skfshim-stuck")
    except BlockingIOError:
        break
    queued.append(c)
start = time.time()
s = socket.socket()                            # falls back: a container socket
assert s.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) == socket.AF_INET
assert time.time() - start < 2, "socket() took %.1fs" % (time.time() - start)
print("stuck broker ok", len(queued))
EOF2
}
check broker-stuck-falls-back stuck_broker

# the app's timer signals interrupt the shim's wait for the broker's hello:
# it waits on (here 200 ms, signals every 10 ms) instead of falling back
signals_during_hello() {
	inc timeout 10 env LD_PRELOAD=$SHIM SKIFF_BROKER=skfshim-slow $PY - <<'EOF2'
import signal, socket, struct, threading, time
ls = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); ls.bind("\0skfshim-slow"); ls.listen(1)
asked = threading.Event()
def slow():
    c, _ = ls.accept()
    time.sleep(0.2)
    c.send(struct.pack("=IIIB3xIIQ", 0x31464b53, 4, socket.htonl(0x0a620000), 16, socket.htonl(0x0a620002), 0, 0))
    c.settimeout(2)
    try:
        op, n = struct.unpack("=BB10x", c.recv(12))
        if op == ord("S"):
            asked.set()
        c.send(struct.pack("=I", 0))               # none: the shim falls back
    except OSError:
        pass
threading.Thread(target=slow, daemon=True).start()
signal.signal(signal.SIGALRM, lambda *_: None)
signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)  # the handler interrupts poll: EINTR
start = time.time()
s = socket.socket()
took = time.time() - start
signal.setitimer(signal.ITIMER_REAL, 0)
assert asked.wait(2), "the shim gave up on the broker's hello at a signal (after %.3fs)" % took
print("signals during hello ok, socket() took %.3fs" % took)
EOF2
}
check signals-during-hello signals_during_hello

# the app clobbers the shim's pool/broker fds (close_range, dup2 onto high fds): the shim must notice
clobber() {
	shim $PY - <<'EOF2'
import socket, os
def peer(s):
    return s.recv(64).split(b"=")[1].split(b":")[0].decode()
s = socket.create_connection(("10.98.0.1", 7001)); assert peer(s) == "10.98.0.1"; s.close()
os.closerange(3, 65536)                       # close_range(2): bypasses the shim's close()
s = socket.create_connection(("10.98.0.1", 7001)); assert peer(s) == "10.98.0.1"; s.close()
fd = os.open("/dev/null", os.O_RDONLY)
for n in range(600, 1024): os.dup2(fd, n)     # every pool/broker slot now holds /dev/null
for i in range(40):
    s = socket.create_connection(("10.98.0.1", 7001)); assert peer(s) == "10.98.0.1", i; s.close()
for n in range(600, 1024): os.fstat(n)       # the shim never closed the app's fds
print("clobber ok")
EOF2
}
check app-clobbers-pool-fds clobber

# a replaced fd closed behind the shim's back (close_range) and reused by the app: its stale entry must not
# make the shim swap the app's own socket
stale_entry() {
	shim $PY - <<'EOF2'
import socket, os
s = socket.socket(); fd = s.detach()          # replaced, fresh, tracked by the shim
os.closerange(fd, fd + 1)                     # close_range(2): the shim's entry goes stale
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); assert u.fileno() == fd, (u.fileno(), fd)
u.connect(("10.99.0.1", 9))                   # outside the CIDR: a fresh entry would be swapped first
assert u.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_DGRAM
assert u.getsockname()[0] == "10.98.9.2", u.getsockname()
print("stale ok")
EOF2
}
check stale-entry-not-swapped stale_entry

# second broker: --name / SKIFF_BROKER, tiny pool (replies come from on-demand top-ups), many clients at once
nsenter --net=/run/netns/$H $SKB --netns /run/netns/$C --cidr 10.98.0.0/16 --ip 10.98.0.2 \
	--name skiff-b2 --pool 2 --stats "$TMP/stats2" 2>>"$TMP/broker2.log" & B2=$!; PIDS+=($B2)
for _ in $(seq 100); do [ -s "$TMP/stats2" ] && [ "$(stat_slot "$TMP/stats2" 0)" = $((0x354534b53)) ] && break; sleep 0.05; done
many_clients() {
	local pids=() p rc=0
	for i in 1 2 3 4 5 6 7 8; do
		ip netns exec $C env LD_PRELOAD=$SHIM SKIFF_BROKER=skiff-b2 ./sockcheck threads 10.98.0.1 7001 4 40 >"$TMP/mc$i" 2>&1 & pids+=($!)
	done
	for p in "${pids[@]}"; do wait $p || rc=1; done
	# exit flushes are asynchronous: give the broker a moment to read them
	for _ in $(seq 40); do [ "$(stat_slot "$TMP/stats2" 2)" = 1280 ] && [ "$(stat_slot "$TMP/stats2" 5)" = 0 ] && break; sleep 0.05; done
	cat "$TMP"/mc*; echo "b2: handed_out=$(stat_slot "$TMP/stats2" 1) fallback=$(stat_slot "$TMP/stats2" 3) replaced=$(stat_slot "$TMP/stats2" 2) clients_total=$(stat_slot "$TMP/stats2" 4) clients_now=$(stat_slot "$TMP/stats2" 5) errors=$(stat_slot "$TMP/stats2" 6)"
	[ $rc = 0 ] && [ "$(stat_slot "$TMP/stats2" 2)" = 1280 ] && [ "$(stat_slot "$TMP/stats2" 4)" = 8 ] &&
	[ "$(stat_slot "$TMP/stats2" 5)" = 0 ] && [ "$(stat_slot "$TMP/stats2" 6)" = 0 ]
}
check broker-name-small-pool-8-procs many_clients
kill -INT $B2; wait $B2; check broker-sigint-clean-exit test $? = 0

# third broker, whose socket() fails (failsock.so: EMFILE). Shims fall back at once, and the broker retries
# on its timer instead of spinning
nsenter --net=/run/netns/$H env LD_PRELOAD=$DIR/failsock.so $SKB --netns /run/netns/$C \
	--cidr 10.98.0.0/16 --ip 10.98.0.2 --name skiff-b3 --stats "$TMP/stats3" 2>>"$TMP/broker3.log" & B3=$!; PIDS+=($B3)
for _ in $(seq 100); do [ -s "$TMP/stats3" ] && [ "$(stat_slot "$TMP/stats3" 0)" = $((0x354534b53)) ] && break; sleep 0.05; done
check broker-cannot-create-falls-back sc_ok ip netns exec $C env LD_PRELOAD=$SHIM SKIFF_BROKER=skiff-b3 \
	./sockcheck client 10.98.0.1 7001 --server-peer 10.98.0.2 --host no
no_spin() {
	local before after
	before=$(awk '{print $14 + $15}' /proc/$B3/stat); sleep 1; after=$(awk '{print $14 + $15}' /proc/$B3/stat)
	echo "broker CPU over 1 s: $((after - before)) ticks; errors=$(stat_slot "$TMP/stats3" 6)"; grep -c "socket: " "$TMP/broker3.log"
	kill -0 $B3 && [ -n "$before" ] && [ $((after - before)) -lt 20 ] && [ "$(stat_slot "$TMP/stats3" 6)" -gt 0 ]
}
check broker-failing-socket-no-spin no_spin
kill $B3; wait $B3 2>/dev/null

# fourth broker, without CAP_NET_ADMIN/CAP_NET_RAW: it cannot make listeners IP_TRANSPARENT, so they fall
# back to container sockets (reachable over the overlay); clients still get host sockets
nsenter --net=/run/netns/$H setpriv --bounding-set -net_admin,-net_raw $SKB --netns /run/netns/$C \
	--cidr 10.98.0.0/16 --ip 10.98.0.2 --name skiff-b4 --transparent --stats "$TMP/stats4" 2>>"$TMP/broker4.log" & B4=$!; PIDS+=($B4)
for _ in $(seq 100); do [ -s "$TMP/stats4" ] && [ "$(stat_slot "$TMP/stats4" 0)" = $((0x354534b53)) ] && break; sleep 0.05; done
no_transparent() {
	ip netns exec $C env LD_PRELOAD=$SHIM SKIFF_BROKER=skiff-b4 $PY - <<'EOF2' || return 1
import socket
def ck(s): return s.getsockopt(socket.SOL_SOCKET, 71, 8)
cont = ck(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
c = socket.socket(); assert ck(c) != cont, "client not a host socket"
a = socket.socket(); a.listen(); assert ck(a) == cont, "listener stayed a host socket"
print("listener fell back")
EOF2
	cat "$TMP/broker4.log"; grep -q "not made transparent" "$TMP/broker4.log"
}
check broker-without-caps-listener-falls-back no_transparent
kill $B4; wait $B4 2>/dev/null

# fifth broker, out of fds (RLIMIT_NOFILE 12, soft = hard): it cannot accept every client; it must not spin
# on the listener, and it serves new clients once others leave
"${INH[@]}" prlimit --nofile=12:12 $SKB --netns /run/netns/$C --cidr 10.98.0.0/16 --ip 10.98.0.2 \
	--name skiff-b5 --pool 2 --stats "$TMP/stats5" 2>>"$TMP/broker5.log" & B5=$!; PIDS+=($B5)
for _ in $(seq 100); do [ -s "$TMP/stats5" ] && [ "$(stat_slot "$TMP/stats5" 0)" = $((0x354534b53)) ] && break; sleep 0.05; done
out_of_fds() {
	local before after
	inc $PY -c '
import socket, time
held = []
for i in range(10):
    b = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); b.connect("\0skiff-b5"); held.append(b)
print("holding", len(held), flush=True); time.sleep(2.5)' >"$TMP/held" 2>&1 & local hp=$!
	sleep 1
	before=$(awk '{print $14 + $15}' /proc/$B5/stat); sleep 1; after=$(awk '{print $14 + $15}' /proc/$B5/stat)
	echo "broker CPU over 1 s with accept failing: $((after - before)) ticks"; cat "$TMP/held" "$TMP/broker5.log"
	wait $hp
	[ $((after - before)) -lt 20 ] && grep -q "retrying every 100 ms" "$TMP/broker5.log" || return 1
	ip netns exec $C env LD_PRELOAD=$SHIM SKIFF_BROKER=skiff-b5 $PY -c '
import socket
def ck(s): return s.getsockopt(socket.SOL_SOCKET, 71, 8)
assert ck(socket.socket()) != ck(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)), "no host socket after recovery"'
}
check broker-out-of-fds-no-spin out_of_fds
kill $B5; wait $B5 2>/dev/null

# sixth broker, stopped (SIGSTOP) for 0.3 s while a process takes sockets in a burst: the socket() that finds
# the queue empty waits, and from then on the shim asks for the next batch earlier (low-water 8 -> 16)
nsenter --net=/run/netns/$H $SKB --netns /run/netns/$C --cidr 10.98.0.0/16 --ip 10.98.0.2 \
	--name skiff-b6 --stats "$TMP/stats6" 2>>"$TMP/broker6.log" & B6=$!; PIDS+=($B6)
for _ in $(seq 100); do [ -s "$TMP/stats6" ] && [ "$(stat_slot "$TMP/stats6" 0)" = $((0x354534b53)) ] && break; sleep 0.05; done
low_water_adapts() {
	ip netns exec $C env LD_PRELOAD=$SHIM SKIFF_BROKER=skiff-b6 BROKER_PID=$B6 STATS="$TMP/stats6" $PY - <<'EOF2'
import os, signal, socket, struct, threading, time
pid, stats = int(os.environ["BROKER_PID"]), os.environ["STATS"]
def handed(): return struct.unpack("8Q", open(stats, "rb").read(64))[1]
socks = [socket.socket()]                    # asks for 32; waiting for the first batch is no burst
os.kill(pid, signal.SIGSTOP)
threading.Timer(0.3, os.kill, (pid, signal.SIGCONT)).start()
for i in range(51):                          # #25 asks for 32 more (8 due); #33 finds the queue empty
    socks.append(socket.socket())
# low-water 16: the third request went out at #49 (16 due); with 8 it would go out at #57
end = time.time() + 3
while handed() < 96 and time.time() < end: time.sleep(0.02)
print("sockets taken", len(socks), "handed out", handed())
assert handed() == 96, handed()
EOF2
}
check shim-low-water-adapts-to-bursts low_water_adapts
kill $B6; wait $B6 2>/dev/null

# ---------------- stats ----------------
stats_move() {
	local names=(magic handed_out replaced fallback clients_total clients_now errors pid) i
	for i in 0 1 2 3 4 5 6 7; do echo "${names[$i]}=$(stat_slot "$TMP/stats" $i)"; done
	grep -E "sendmsg to|hello to|bad message|bad count|unknown op|accept:|client refused|socket:|fds where none" "$TMP/broker.log"
	[ "$(stat_slot "$TMP/stats" 1)" -ge 2000 ] && [ "$(stat_slot "$TMP/stats" 2)" -ge 2000 ] &&
	[ "$(stat_slot "$TMP/stats" 3)" -ge 4 ] && [ "$(stat_slot "$TMP/stats" 4)" -ge 5 ] &&
	[ "$(stat_slot "$TMP/stats" 6)" = 1 ] && [ "$(stat_slot "$TMP/stats" 7)" = "$BROKER" ]   # broker-validates-passed-fds
}
for _ in $(seq 40); do [ "$(stat_slot "$TMP/stats" 5)" = 0 ] && break; sleep 0.05; done
check stats-counters-move stats_move

# ---------------- EAGAIN on blocking reads ----------------
# eagain.so fails each stream socket's first read with EAGAIN, as a
# channelled socket's blocking read can on Linux 6.18: the shim waits and
# reads again for a blocking socket (every read call); a non-blocking
# socket, MSG_DONTWAIT, MSG_ERRQUEUE and a receive timeout still see
# EAGAIN; a signal ends the wait (EINTR).
cat >"$TMP/eagain.py" <<'EOF'
import os, signal, socket, struct, sys, threading, time
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(16)
def serve():
    while True:
        c, _ = ls.accept()
        time.sleep(0.1)
        c.sendall(b"hello")
        time.sleep(0.3)
        c.close()
threading.Thread(target=serve, daemon=True).start()
def conn():
    return socket.create_connection(ls.getsockname())
reads = {
    "recv": lambda s: s.recv(5),
    "recvfrom": lambda s: s.recvfrom(5)[0],
    "recvmsg": lambda s: s.recvmsg(5)[0],
    "read": lambda s: os.read(s.fileno(), 5),
    "readv": lambda s: (lambda b: b[:os.readv(s.fileno(), [b])])(bytearray(5)),
}
bad = 0
for name, rd in reads.items():
    s = conn()
    try:
        got = bytes(rd(s))
    except OSError as e:
        got = repr(e)
    print(name, got)
    bad += got != b"hello"
    s.close()
def eagain(setup, rd):
    s = conn()
    time.sleep(0.2)
    setup(s)
    try:
        rd(s)
        return False
    except BlockingIOError:
        return True
    finally:
        s.close()
for name, ok in [
        ("non-blocking", eagain(lambda s: s.setblocking(False), lambda s: s.recv(5))),
        ("MSG_DONTWAIT", eagain(lambda s: None, lambda s: s.recv(5, socket.MSG_DONTWAIT))),
        ("SO_RCVTIMEO", eagain(lambda s: s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 1, 0)), lambda s: s.recv(5))),
        ("MSG_ERRQUEUE", eagain(lambda s: None, lambda s: s.recvmsg(5, 0, socket.MSG_ERRQUEUE)))]:
    print(name, "EAGAIN" if ok else "no EAGAIN")
    bad += not ok
# A signal ends a wait for data that never comes, as it ends a read.
class Alarm(Exception):
    pass
def on_alarm(*_):
    raise Alarm()
signal.signal(signal.SIGALRM, on_alarm)
quiet = socket.socket()
quiet.bind(("127.0.0.1", 0))
quiet.listen(1)
q = socket.create_connection(quiet.getsockname())
signal.setitimer(signal.ITIMER_REAL, 0.3)
try:
    q.recv(1)
    got = "data"
except Alarm:
    got = "EINTR"
except OSError as e:
    got = repr(e)
print("signal", got)
bad += got != "EINTR"
print("ok" if bad == 0 else "FAIL %d" % bad)
EOF
check eagain-injected-without-shim sh -c "timeout 20 ip netns exec $C env LD_PRELOAD=$DIR/eagain.so $PY $TMP/eagain.py | grep -q '^FAIL 6$'"
check shim-retries-eagain-on-blocking-reads sc_ok timeout 20 ip netns exec $C env LD_PRELOAD="$SHIM $DIR/eagain.so" SKIFF_SOCKETS=off $PY "$TMP/eagain.py"

# ---------------- broker gone ----------------
# a long-running process keeps working while the broker is killed and restarted
"${SHIMC[@]}" $PY - >"$TMP/long" 2>&1 <<'EOF' & LRP=$!; PIDS+=($LRP)
import socket, time
peers = []
end = time.time() + 4.0
while time.time() < end:
    s = socket.create_connection(("10.98.0.1", 7001))
    h = s.recv(64); s.sendall(b"x"); assert s.recv(1) == b"x"; s.close()
    peers.append(h.split(b"=")[1].split(b":")[0].decode())
    time.sleep(0.005)
print(len(peers), "conns; host", peers.count("10.98.0.1"), "container", peers.count("10.98.0.2"), "last", peers[-1])
assert peers[-1] == "10.98.0.1" and peers.count("10.98.0.2") > 0
EOF
sleep 0.7
kill -TERM $BROKER; wait $BROKER; brc=$?
check broker-sigterm-clean-exit test $brc = 0
check broker-down-new-process sc_ok shim ./sockcheck client 10.98.0.1 7001 --server-peer 10.98.0.2 --host no
check broker-down-curl sh -c "ip netns exec $C env LD_PRELOAD=$SHIM curl -sf http://10.98.0.1:8080/index.html | grep -q skiff-hello"
sleep 0.3
start_broker || fail "broker restart"
wait $LRP; lrc=$?; cat "$TMP/long"
check broker-restart-long-running-recovers test $lrc = 0

echo "--- broker log (tail) ---"; grep -c "fallback event" "$TMP/broker.log" | sed "s/^/fallback events logged: /"; tail -4 "$TMP/broker.log"
echo "elapsed $(( $(date +%s) - T0 ))s"
if [ $FAILS -gt 0 ]; then echo "$FAILS check(s) FAILED"; exit 1; fi
echo "all checks passed"
