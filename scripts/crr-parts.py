#!/usr/bin/env python3
"""scripts/crr-parts.py [--pairs N] [--workload tcp_crr|memcached_crr] [--seconds S]

Where a sockets-mode connection's cost lies. One sockets lab, three clients
in turn (the order reversed every other round), each against a server of its
own kind:
  host     a process of h2's host namespace, to one of h1's (the baseline)
  sockets  a process of container h2/c1 through the shim, to h1/c1's replaced listener
  noshim   a process of h2's host namespace in h2/c1's cgroup, without the shim:
           it creates its own host sockets, which the container's programs take
           as the container's (the kernel path, with the broker and shim left out)

tcp_crr is one connection after another (bound by each connection's latency);
memcached_crr is 50 connections at once, a new one per request (bound by CPU).
Prints each client's median rate and its paired median ratio to host, and the
CPU per transaction of the client, the server, the brokers and the whole
machine (process times include the network processing the kernel does in the
process's context).
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIFF, PERF = os.path.join(ROOT, "bin", "skiff"), os.path.join(ROOT, "bin", "skiff-perf")
LAB = "crrparts"
HZ = os.sysconf("SC_CLK_TCK")


def skiff(*args, **kw):
    return subprocess.run([SKIFF, *args], check=True, capture_output=True, text=True, **kw).stdout


def proc_ticks(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime
    except OSError:
        return 0


def machine_ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4] - v[7]  # all but idle, iowait, steal


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=14, help="rounds of the three clients")
    ap.add_argument("--workload", choices=["tcp_crr", "memcached_crr"], default="tcp_crr")
    ap.add_argument("--seconds", type=float, default=3, help="length of each cell")
    o = ap.parse_args()

    subprocess.run([SKIFF, "lab", "down", "--name", LAB], capture_output=True)
    servers = []
    try:
        skiff("lab", "up", "--name", LAB, "--mode", "sockets", "--containers-per-host", "1")
        st = json.loads(skiff("lab", "status", "--name", LAB, "--json"))
        hosts, ctrs = st["hosts"], {c["name"]: c for c in st["containers"]}
        h1_ip, c1_ip = hosts[0]["underlayIP"], ctrs["h1/c1"]["ip"]
        h2_netns, c2_cgroup = hosts[1]["netns"], ctrs["h2/c1"]["cgroup"]
        brokers = [f for h in hosts for f in glob.glob(os.path.join(os.path.dirname(h["socket"]), "state", "brokers", "*.pid"))]
        broker_ticks = lambda: sum(proc_ticks(int(open(f).read())) for f in brokers)

        def server(target, ip, port):
            if o.workload == "tcp_crr":
                cmd = [PERF, "server", "--bind", ip, "--port", str(port)]
            else:
                cmd = ["memcached", "-u", "root", "-l", ip, "-p", str(port), "-U", "0", "-t", "2"]
            p = subprocess.Popen([SKIFF, "lab", "exec", "--name", LAB, target, "--", *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            servers.append(p)
            return cmd

        cmds = {"host": server("h1", h1_ip, 13010), "sockets": server("h1/c1", c1_ip, 13000)}
        time.sleep(2)
        spid = {}
        for k, cmd in cmds.items():
            out = subprocess.run(["pgrep", "-f", "-x", " ".join(cmd)], capture_output=True, text=True).stdout.split()
            if not out:
                sys.exit(f"crr-parts: the {k} server did not start")
            spid[k] = int(out[-1])

        def client(kind):
            ip, port = (h1_ip, 13010) if kind == "host" else (c1_ip, 13000)
            test = ["--test", "tcp_crr"] if o.workload == "tcp_crr" else ["--test", "memcached", "--connections", "50", "--new-conn"]
            cmd = [PERF, "client", *test, "--host", ip, "--port", str(port), "--duration", str(o.seconds)]
            if kind == "noshim":  # into the cgroup first: ip netns exec mounts a sysfs of its own
                cmd = ["sh", "-c", 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"', "_", c2_cgroup, "ip", "netns", "exec", h2_netns, *cmd]
            else:
                cmd = [SKIFF, "lab", "exec", "--name", LAB, "h2" if kind == "host" else "h2/c1", "--", *cmd]
            srv = spid["host" if kind == "host" else "sockets"]
            b0, s0, m0 = broker_ticks(), proc_ticks(srv), machine_ticks()
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            out = p.stdout.read()
            _, status, ru = os.wait4(p.pid, 0)
            m1, s1, b1 = machine_ticks(), proc_ticks(srv), broker_ticks()
            if status:
                sys.exit(f"crr-parts: {kind} client failed: {out}")
            res = json.loads(out)
            n = res["transactions"]
            us = lambda ticks: ticks * 1e6 / HZ / n
            return {"rate": n / res["duration_s"], "client": (ru.ru_utime + ru.ru_stime) * 1e6 / n,
                    "server": us(s1 - s0), "broker": us(b1 - b0), "machine": us(m1 - m0)}

        kinds = ["host", "sockets", "noshim"]
        cells = {k: [] for k in kinds}
        for i in range(o.pairs):
            for k in kinds if i % 2 == 0 else kinds[::-1]:
                cells[k].append(client(k))
    finally:
        for p in servers:
            p.terminate()
        for p in servers:
            p.wait()
        subprocess.run([SKIFF, "lab", "down", "--name", LAB], capture_output=True)

    med = lambda k, f: statistics.median(c[f] for c in cells[k])
    print(f"{o.workload}, {o.pairs} rounds of {o.seconds:g} s cells; CPU in µs per transaction (median)")
    print(f"{'client':8} {'rate':>9} {'vs host':>8} {'client':>8} {'server':>8} {'brokers':>8} {'machine':>8}")
    for k in kinds:
        ratio = statistics.median(c["rate"] / h["rate"] for c, h in zip(cells[k], cells["host"]))
        print(f"{k:8} {med(k, 'rate'):9.0f} {ratio:7.3f}x" + "".join(f" {med(k, f):8.1f}" for f in ("client", "server", "broker", "machine")))


if __name__ == "__main__":
    main()
