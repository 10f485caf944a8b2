// Command skiffd is skiff's per-host agent.
package main

import (
	"cmp"
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

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/skiffnet/skiff/agent"
	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/flagfile"
	"github.com/skiffnet/skiff/kube"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/source"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/version"
)

func main() {
	err := run(os.Args[1:])
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
		// --help: the usage went to stderr; asking for it is no failure.
	default:
		fmt.Fprintln(os.Stderr, "skiffd:", err)
		os.Exit(2)
	}
}

func run(args []string) error {
	hostname, _ := os.Hostname()
	fs := flag.NewFlagSet("skiffd", flag.ContinueOnError)
	name := fs.String("name", hostname, "this host's name in the cluster")
	underlay := fs.String("underlay-interface", "", "interface carrying the underlay address (default: that of the default route)")
	endpoints := fs.String("etcd-endpoints", "", "comma-separated etcd client URLs of an external cluster")
	var embedded embeddedStore
	embedded.define(fs)
	var creds store.TLS
	fs.StringVar(&creds.CAFile, "etcd-cafile", "", "CA certificate that signed the etcd server's certificate")
	fs.StringVar(&creds.CertFile, "etcd-certfile", "", "this host's etcd client certificate (common name: the host's --name)")
	fs.StringVar(&creds.KeyFile, "etcd-keyfile", "", "key of the etcd client certificate")
	fs.BoolVar(&creds.Insecure, "etcd-insecure", false, "reach (and serve, with --embedded-etcd) the cluster store over plain HTTP without authentication")
	socket := fs.String("socket", api.DefaultSocket, "path of the API socket")
	stateDir := fs.String("state-dir", "/var/lib/skiff", "directory for local state")
	cidr := fs.String("cluster-cidr", "10.244.0.0/16", "overlay address range, cut into per-host subnets")
	hostPrefix := fs.Int("host-prefix", 24, "length of each host's subnet")
	vni := fs.Int("vni", 1, "VXLAN network identifier")
	port := fs.Int("vxlan-port", 4789, "VXLAN UDP port")
	mode := fs.String("mode", "auto", "data-plane mode: "+strings.Join(agent.Modes(), ", ")+" (auto: every layer this host can run; docs/layers.md)")
	layers := fs.String("layers", "", "run exactly these layers, comma-separated (e.g. cache,sockets; none: the overlay alone), instead of a --mode")
	bpfDir := fs.String("bpf-dir", "/sys/fs/bpf/skiff", "bpffs directory for pinned eBPF maps and links (the source check; each layer in a directory of its own)")
	cgroupRoot := fs.String("cgroup-root", "", "cgroup v2 mount containers' cgroups are under, for the layers that hook them (default: the system's cgroup v2 mount, else one made at "+cgroup.DefaultRoot+")")
	var underlayRate uint64
	fs.Func("underlay-rate", "the underlay's real rate (tc units: 1gbit): shaped to it, QoS classes keep their shares under contention (docs/limits.md); default: not shaped", func(v string) (err error) {
		underlayRate, err = cluster.ParseRate(v)
		if err == nil && underlayRate != 0 && underlayRate < cluster.MinRate {
			err = fmt.Errorf("below %s", cluster.FormatRate(cluster.MinRate))
		}
		return err
	})
	layerOptions := layer.DefineFlags(fs)
	metrics := fs.String("metrics-addr", "", "serve Prometheus metrics on this address (e.g. :9473); off when empty")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	config := fs.String("config", "", "read flags from this file, one \"flag = value\" a line (deploy/skiffd.conf); the command line overrides it")
	var k8s kubeFlags
	k8s.define(fs)
	showVersion := fs.Bool("version", false, "print the version and exit")
	cleanup := fs.Bool("cleanup", false, "remove everything skiffd made on this host (devices, iptables chains, tc filters, pinned eBPF state, brokers, state files; an embedded etcd's data stays) and exit; skiffd must be stopped")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	// A config file is read before --version, so that
	// skiffd --config FILE --version checks the file.
	if *config != "" {
		if err := flagfile.Apply(fs, *config); err != nil {
			return err
		}
	}
	if *showVersion {
		fmt.Println("skiffd", version.String())
		return nil
	}
	var layerList []string
	if layer.IsSet(fs, "layers") {
		if layer.IsSet(fs, "mode") {
			return errors.New("give --mode or --layers, not both")
		}
		*mode, layerList = "", []string{}
		if *layers != "none" {
			layerList = append(layerList, layer.SplitList(*layers)...)
		}
	}
	options, err := layerOptions(layer.Settings{Mode: *mode, CgroupRoot: *cgroupRoot})
	if err != nil {
		return err
	}
	if *cleanup {
		return cleanupHost(agent.CleanupConfig{StateDir: *stateDir, BPFDir: *bpfDir, Socket: *socket, LayerOptions: options, Keep: layer.SplitList(embedded.dir)})
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
	log.Info("skiffd starting", "version", version.Release, "commit", version.Commit(), "host", *name)
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

	etcd := layer.SplitList(*endpoints)
	var serves []string
	if *metrics != "" {
		serves = append(serves, *metrics)
	}
	if embedded.dir != "" {
		e, served, err := embedded.start(ctx, *name, &creds, log)
		if err != nil {
			return err
		}
		defer e.Close()
		etcd, serves = append(etcd, e.URL), append(serves, served...)
	}
	var src source.Backend
	if k8s.on {
		if src, err = k8s.open(ctx, *name, *stateDir, log); err != nil {
			return err
		}
	} else {
		if len(etcd) == 0 {
			return errors.New("no cluster store: give --etcd-endpoints or --embedded-etcd (or --kubernetes)")
		}
		if err := checkCredentials(creds, *name, log); err != nil {
			return err
		}
	}
	a, err := agent.New(agent.Config{Source: src, CNIConfDir: k8s.cniConfDir,
		Name: *name, Underlay: *underlay, EtcdEndpoints: etcd, EtcdTLS: creds, Socket: *socket, StateDir: *stateDir, Mode: *mode, Layers: layerList,
		BPFDir: *bpfDir, UnderlayRate: underlayRate, LayerOptions: options,
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
	if err := a.Run(ctx); errors.Is(err, store.ErrPermission) && k8s.on {
		return fmt.Errorf("%w\nthe API server refuses what skiffd asks as this identity: it needs the ClusterRole and Role of deploy/kubernetes/skiff.yaml (docs/kubernetes.md)", err)
	} else if errors.Is(err, store.ErrPermission) {
		return fmt.Errorf("%w\nthe store has no user and role for host %s (or they lack a right): the administrator makes them with skiff cert allow --ca-dir DIR --name %s --etcd-endpoints URL", err, *name, *name)
	} else if err != nil {
		return err
	}
	return nil
}

// cleanupHost runs skiffd --cleanup and says what it removed.
func cleanupHost(cfg agent.CleanupConfig) error {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	removed, err := agent.Cleanup(cfg, log)
	for _, r := range removed {
		fmt.Println("removed", r)
	}
	if len(removed) == 0 && err == nil {
		fmt.Println("nothing of skiff's left on this host")
	}
	return err
}

// embeddedStore is what the --embedded-etcd flags say.
type embeddedStore struct{ dir, listen, peer, initialCluster, state string }

func (e *embeddedStore) define(fs *flag.FlagSet) {
	fs.StringVar(&e.dir, "embedded-etcd", "", "run an embedded etcd server with its data in this directory")
	fs.StringVar(&e.listen, "embedded-etcd-listen", "", "client URL of the embedded etcd (default https://127.0.0.1:2379, http:// with --etcd-insecure)")
	fs.StringVar(&e.peer, "embedded-etcd-peer", "", "peer URL of the embedded etcd (default https://127.0.0.1:2380, http:// with --etcd-insecure)")
	fs.StringVar(&e.initialCluster, "embedded-etcd-initial-cluster", "", "every member of a multi-member embedded etcd as NAME=PEER-URL,... (etcd's --initial-cluster; a member's NAME is its host's --name); default: this member alone")
	fs.StringVar(&e.state, "embedded-etcd-initial-cluster-state", "new", "new: form the cluster of --embedded-etcd-initial-cluster; existing: join a running cluster that lists this member (etcdctl member add)")
}

// start runs the embedded etcd of host name: it and the URLs it serves.
func (e *embeddedStore) start(ctx context.Context, name string, creds *store.TLS, log *slog.Logger) (*store.Embedded, []string, error) {
	scheme := "https"
	if creds.Insecure {
		scheme = "http"
	}
	listen := cmp.Or(e.listen, scheme+"://127.0.0.1:2379")
	peer := cmp.Or(e.peer, scheme+"://127.0.0.1:2380")
	cfg := store.EmbeddedConfig{Dir: e.dir, ClientURL: listen, PeerURL: peer, Insecure: creds.Insecure, Log: log}
	if err := memberFlags(&cfg, name, e.initialCluster, e.state); err != nil {
		return nil, nil, err
	}
	s, err := startEmbedded(ctx, name, cfg, creds, log)
	if err != nil {
		return nil, nil, err
	}
	return s, []string{listen, peer}, nil
}

// memberFlags makes the embedded etcd a member of several, named after
// its host, when an initial cluster is given.
func memberFlags(cfg *store.EmbeddedConfig, name, initial, state string) error {
	switch state {
	case "new":
	case "existing":
		if initial == "" {
			return errors.New("--embedded-etcd-initial-cluster-state existing needs --embedded-etcd-initial-cluster: every member of the cluster joined, this one included")
		}
		cfg.Join = true
	default:
		return fmt.Errorf("--embedded-etcd-initial-cluster-state %q: choose new or existing", state)
	}
	if initial != "" {
		cfg.Name, cfg.InitialCluster = name, initial
	}
	return nil
}

// startEmbedded runs the embedded etcd, over TLS unless creds say
// insecure, and gives the agent beside it a client certificate of its own
// when it has none. On the first start it says how other hosts join.
func startEmbedded(ctx context.Context, name string, cfg store.EmbeddedConfig, creds *store.TLS, log *slog.Logger) (*store.Embedded, error) {
	e, err := store.StartEmbedded(ctx, cfg)
	if err != nil {
		return nil, err
	}
	log.Info("embedded etcd serving", "url", e.URL, "dir", cfg.Dir, "tls", !creds.Insecure)
	if creds.Insecure {
		return e, nil
	}
	// The store checks every client's rights: this host's agent gets its
	// own user and role, as other hosts get theirs from skiff cert issue.
	if err := allowHost(ctx, e, name); err != nil {
		e.Close()
		return nil, err
	}
	if creds.CAFile == "" && creds.CertFile == "" && creds.KeyFile == "" {
		if *creds, err = e.ClientTLS(name); err != nil {
			e.Close()
			return nil, err
		}
	}
	if e.CreatedPKI {
		pki := e.PKI.Dir
		log.Info("to join another host HOST: issue its certificate here, copy the directory to it, and start its agent with the certificate",
			"issue", "skiff cert issue --ca-dir "+pki+" --name HOST --out HOST-pki --etcd-endpoints "+e.URL+" (also makes HOST's user and role in the store)",
			"copy", "HOST-pki/ to /etc/skiff/pki/ on HOST (mode 0700; it holds HOST's key)",
			"run", "skiffd --name HOST --etcd-endpoints "+e.URL+" --etcd-cafile /etc/skiff/pki/ca.crt --etcd-certfile /etc/skiff/pki/HOST.crt --etcd-keyfile /etc/skiff/pki/HOST.key",
			"admin", "the administrator's certificate is "+e.PKI.ClientTLS(store.AdminName).CertFile)
	}
	return e, nil
}

func allowHost(ctx context.Context, e *store.Embedded, name string) error {
	admin, err := e.Admin()
	if err != nil {
		return err
	}
	defer admin.Close()
	return admin.AllowHost(ctx, name)
}

// checkCredentials refuses a client certificate issued for another host
// (the store knows a client by its certificate's common name) and warns of
// plain HTTP and of a certificate about to expire.
func checkCredentials(creds store.TLS, name string, log *slog.Logger) error {
	if creds.Insecure {
		log.Warn("reaching the cluster store over plain HTTP without authentication (--etcd-insecure)")
		return nil
	}
	if creds.CertFile == "" {
		return nil // store.Open says what is missing
	}
	cn, err := creds.CommonName()
	if err != nil {
		return err
	}
	if cn != name {
		return fmt.Errorf("etcd client certificate %s is for %q, not this host %q: issue one with skiff cert issue --name %s", creds.CertFile, cn, name, name)
	}
	if end := creds.ExpiresSoon(); !end.IsZero() {
		log.Warn("the etcd client certificate expires soon: issue a new one with skiff cert issue", "file", creds.CertFile, "notAfter", end)
	}
	return nil
}

// kubeFlags are what the --kubernetes flags say.
type kubeFlags struct {
	on                                bool
	kubeconfig, namespace, cniConfDir string
}

func (k *kubeFlags) define(fs *flag.FlagSet) {
	fs.BoolVar(&k.on, "kubernetes", false, "take the cluster from the Kubernetes API (Nodes' pod CIDRs, pods, NetworkPolicy) instead of etcd (docs/kubernetes.md)")
	fs.StringVar(&k.kubeconfig, "kubeconfig", "", "with --kubernetes: the kubeconfig to reach the API server with (default: the pod's service account)")
	fs.StringVar(&k.namespace, "kube-namespace", "skiff-system", "with --kubernetes: skiff's namespace (its cluster configuration)")
	fs.StringVar(&k.cniConfDir, "cni-conf-dir", "", "write skiff's CNI configuration into this directory once the agent is ready (e.g. /etc/cni/net.d)")
}

// open connects to the API server and starts the Kubernetes source.
func (k *kubeFlags) open(ctx context.Context, node, stateDir string, log *slog.Logger) (source.Backend, error) {
	var cfg *rest.Config
	var err error
	if k.kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", k.kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("--kubernetes: %w", err)
	}
	cfg.UserAgent = "skiffd/" + version.Release + " (" + node + ")"
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("--kubernetes: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("--kubernetes: %w", err)
	}
	return kube.New(ctx, kube.Config{Node: node, Namespace: k.namespace, StateDir: stateDir, Log: log}, client, dyn)
}
