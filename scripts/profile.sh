#!/usr/bin/env bash
# Where does the time go? Runs one skiff-perf workload between two containers
# on a fresh lab in MODE and reports the cost per run of every skiff eBPF
# program (kernel.bpf_stats_enabled) and a system-wide perf profile.
#   usage: scripts/profile.sh MODE [tcp_rr|udp_rr|tcp_crr|connect] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/profile.sh MODE [WORKLOAD] [SECONDS]}
test=${2:-tcp_rr}
secs=${3:-4}
bin=$PWD/bin
name=prof
out=$(mktemp -d /tmp/skiff-profile.XXXX)
$bin/skiff lab down --name $name >/dev/null 2>&1 || true
$bin/skiff lab up --name $name --mode "$mode" --containers-per-host 1 >/dev/null
srv=
cleanup() {
	[ -n "$srv" ] && kill "$srv" 2>/dev/null
	sysctl -q kernel.bpf_stats_enabled=0
	$bin/skiff lab down --name $name
}
trap cleanup EXIT
dst=$($bin/skiff lab ip --name $name h2/c1)
$bin/skiff lab exec --name $name h2/c1 -- "$bin/skiff-perf" server --bind "$dst" --port 30000 &
srv=$!
sleep 0.5
client=("$bin/skiff" lab exec --name $name h1/c1 -- "$bin/skiff-perf" client --host "$dst" --port 30000 --test "$test")
"${client[@]}" --duration 1 >/dev/null # warm the caches
sysctl -q kernel.bpf_stats_enabled=1
perf record -q -e cpu-clock -a -g -o "$out/perf.data" -- "${client[@]}" --duration "$secs"
echo "== eBPF programs (both hosts), average cost per run"
bpftool -j prog show 2>/dev/null | python3 -c '
import json, re, sys
for p in json.load(sys.stdin):
    name, runs = p.get("name", ""), p.get("run_cnt", 0)
    if runs and re.match(r"(sks_|skv_|(from|to)_(container|underlay))", name):
        print("  %-16s %7.0f ns/run  (%d runs)" % (name, p["run_time_ns"] / runs, runs))'
echo "== perf: top kernel symbols (profile in $out/perf.data)"
perf report -q -i "$out/perf.data" --no-children --sort symbol --stdio -g none 2>/dev/null | head -25
