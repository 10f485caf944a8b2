#!/usr/bin/env bash
# scripts/crr-parts.sh [PAIRS]: where a sockets-mode connection's cost lies.
# tcp_crr (skiff-perf, 3 s cells) in one sockets lab, three clients in turn,
# each against a server of the same kind as itself:
#   host     a process of h2's host namespace, to one of h1's (the baseline)
#   sockets  a process of container h2/c1 through the shim, to h1/c1's replaced listener
#   noshim   a process of h2's host namespace in h2/c1's cgroup, without the shim:
#            it creates its own host sockets, which the container's programs
#            take as the container's (what the broker and shim do, left out)
# Prints each client's median and its paired median ratio to host.
set -euo pipefail
cd "$(dirname "$0")/.."
skiff=./bin/skiff perf=./bin/skiff-perf name=crrparts pairs=${1:-14}

$skiff lab down --name $name >/dev/null 2>&1 || true
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	$skiff lab down --name $name >/dev/null 2>&1 || true
}
trap cleanup EXIT
$skiff lab up --name $name --mode sockets --containers-per-host 1 >/dev/null

status=$($skiff lab status --name $name --json)
read -r h2_netns c2_cgroup c1_ip h1_ip < <(python3 -c '
import json, sys
d = json.loads(sys.argv[1])
c = {x["name"]: x for x in d["containers"]}
print(d["hosts"][1]["netns"], c["h2/c1"]["cgroup"], c["h1/c1"]["ip"], d["hosts"][0]["underlayIP"])' "$status")

$skiff lab exec --name $name h1/c1 -- $perf server --port 13000 >/dev/null 2>&1 & pids+=($!)
$skiff lab exec --name $name h1 -- $perf server --port 13010 >/dev/null 2>&1 & pids+=($!)
sleep 2

client() { # kind
	local args=(client --test tcp_crr --duration 3)
	case $1 in
	host) $skiff lab exec --name $name h2 -- $perf "${args[@]}" --host "$h1_ip" --port 13010 ;;
	sockets) $skiff lab exec --name $name h2/c1 -- $perf "${args[@]}" --host "$c1_ip" --port 13000 ;;
	# into the cgroup first: ip netns exec mounts a sysfs of its own
	noshim) sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$c2_cgroup" \
		ip netns exec "$h2_netns" $perf "${args[@]}" --host "$c1_ip" --port 13000 ;;
	esac | python3 -c 'import json,sys; print(int(json.load(sys.stdin)["rate"]))'
}

out=$(for _ in $(seq "$pairs"); do
	for k in host sockets noshim; do echo "$k $(client $k)"; done
done)
python3 - "$out" <<'EOF'
import statistics, sys
by = {}
for line in sys.argv[1].splitlines():
    k, v = line.split()
    by.setdefault(k, []).append(int(v))
for k in ("host", "sockets", "noshim"):
    ratio = statistics.median(x / h for x, h in zip(by[k], by["host"]))
    print(f"{k:8} median {statistics.median(by[k]):7.0f} connections/s, {ratio:.3f}x host (paired median of {len(by[k])})")
EOF
