// Command skiffd is skiff's per-host agent.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/skiffnet/skiff/agent"
	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cache"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/sockets"
	"github.com/skiffnet/skiff/store"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "skiffd:", err)
		}
		os.Exit(2)
	}
}

func run(args []string) error {
	hostname, _ := os.Hostname()
	fs := flag.NewFlagSet("skiffd", flag.ContinueOnError)
	name := fs.String("name", hostname, "this host's name in the cluster")
	underlay := fs.String("underlay-interface", "", "interface carrying the underlay address (default: that of the default route)")
	endpoints := fs.String("etcd-endpoints", "", "comma-separated etcd client URLs of an external cluster")
	embedded := fs.String("embedded-etcd", "", "run an embedded etcd server with its data in this directory")
	embeddedListen := fs.String("embedded-etcd-listen", "http://127.0.0.1:2379", "client URL of the embedded etcd")
	embeddedPeer := fs.String("embedded-etcd-peer", "http://127.0.0.1:2380", "peer URL of the embedded etcd")
	socket := fs.String("socket", api.DefaultSocket, "path of the API socket")
	stateDir := fs.String("state-dir", "/var/lib/skiff", "directory for local state")
	cidr := fs.String("cluster-cidr", "10.244.0.0/16", "overlay address range, cut into per-host subnets")
	hostPrefix := fs.Int("host-prefix", 24, "length of each host's subnet")
	vni := fs.Int("vni", 1, "VXLAN network identifier")
	port := fs.Int("vxlan-port", 4789, "VXLAN UDP port")
	mode := fs.String("mode", "overlay", "data-plane mode: "+strings.Join(agent.Modes, ", "))
	bpfDir := fs.String("bpf-dir", "/sys/fs/bpf/skiff", "bpffs directory for pinned eBPF maps and links (cache and sockets modes)")
	secure := fs.Bool("sockets-secure", true, "sockets mode: host sockets may only reach overlay listeners and may not change priority, TOS, mark or device")
	broker := fs.String("broker", "", "sockets mode: the skiff-broker binary (default: next to skiffd)")
	cgroupRoot := fs.String("cgroup-root", "", "sockets mode: cgroup v2 mount containers' cgroups are under (default: the system's cgroup v2 mount, else one made at "+sockets.DefaultCgroupRoot+")")
	capacity := cache.DefaultCapacity
	fs.Func("cache-capacity", fmt.Sprintf("cache sizes as egress-ips,egress-hosts,ingress,flows (default %d,%d,%d,%d)",
		capacity.EgressIPs, capacity.EgressHosts, capacity.Ingress, capacity.Filter), func(v string) error {
		_, err := fmt.Sscanf(v, "%d,%d,%d,%d", &capacity.EgressIPs, &capacity.EgressHosts, &capacity.Ingress, &capacity.Filter)
		return err
	})
	metrics := fs.String("metrics-addr", "", "serve Prometheus metrics on this address (e.g. :9473); off when empty")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
	prefix, err := netip.ParsePrefix(*cidr)
	if err != nil {
		return fmt.Errorf("--cluster-cidr: %w", err)
	}
	if *underlay == "" {
		if *underlay, err = overlay.DefaultUnderlay(); err != nil {
			return err
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	etcd := splitList(*endpoints)
	var serves []string
	if *metrics != "" {
		serves = append(serves, *metrics)
	}
	if *embedded != "" {
		serves = append(serves, *embeddedListen, *embeddedPeer)
		e, err := store.StartEmbedded(ctx, *embedded, *embeddedListen, *embeddedPeer)
		if err != nil {
			return err
		}
		defer e.Close()
		etcd = append(etcd, e.URL)
		log.Info("embedded etcd serving", "url", e.URL, "dir", *embedded)
	}
	if len(etcd) == 0 {
		return errors.New("no cluster store: give --etcd-endpoints or --embedded-etcd")
	}
	a, err := agent.New(agent.Config{
		Name: *name, Underlay: *underlay, EtcdEndpoints: etcd, Socket: *socket, StateDir: *stateDir, Mode: *mode,
		BPFDir: *bpfDir, CacheCapacity: capacity, SocketsSecure: *secure, Broker: *broker, CgroupRoot: *cgroupRoot,
		Cluster: cluster.Config{CIDR: prefix, HostPrefix: *hostPrefix, VNI: *vni, VXLANPort: *port}, Serves: serves,
	}, log)
	if err != nil {
		return err
	}
	if *metrics != "" {
		if err := a.ServeMetrics(ctx, *metrics); err != nil {
			return err
		}
	}
	return a.Run(ctx)
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
