#!/usr/bin/env bash
# make run: a 2-host lab with 2 containers each and every layer on (auto),
# cross-host traffic, then the quick benchmark table (host, overlay, cache,
# sockets and auto).
set -euo pipefail
cd "$(dirname "$0")/.."
skiff=./bin/skiff
name=demo

$skiff lab down --name $name >/dev/null 2>&1 || true
trap '$skiff lab down --name $name' EXIT

$skiff lab up --name $name --hosts 2 --containers-per-host 2
echo
src=h1/c1 dst=h2/c1
dst_ip=$($skiff lab ip --name $name $dst)
echo "== $src -> $dst ($dst_ip): ICMP across hosts (the overlay, then the cache)"
$skiff lab exec --name $name $src -- ping -c 3 -i 0.2 "$dst_ip" | tail -2
echo
echo "== $src -> $dst: TCP (iperf3, 3 s; preloaded: host sockets)"
$skiff lab exec --name $name $dst -- iperf3 -s -1 -B "$dst_ip" -p 5201 >/dev/null &
sleep 0.5
$skiff lab exec --name $name $src -- iperf3 -c "$dst_ip" -p 5201 -t 3 | grep -E 'sender|receiver'
wait
echo
echo "== hosts and endpoints, as the agent on h1 sees them"
sock=$($skiff lab status --name $name --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["hosts"][0]["socket"])')
$skiff hosts --socket "$sock"
$skiff endpoints --all --socket "$sock"
echo
echo "== which layers run, as the agent on h1 sees them"
$skiff status --socket "$sock" | sed -n '/^mode/,/^store/p' | grep -v '^store'
echo
echo "== quick benchmark: host network vs overlay vs cache vs sockets vs auto, one interleaved run (skiff bench --quick)"
$skiff bench --quick --modes host,overlay,cache,sockets,auto --lab $name
