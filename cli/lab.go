package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/skiffnet/skiff/agent"
	"github.com/skiffnet/skiff/lab"
	"github.com/skiffnet/skiff/store"
)

const labUsage = `usage: skiff lab COMMAND [flags]   (skiff lab COMMAND --help lists its flags)

commands:
  up      bring up a lab: an etcd cluster, hosts running skiffd, containers on them
  down    remove a lab and everything it made, also after a crash
  exec    run a program in a host or container: exec [--name LAB] TARGET -- COMMAND [ARGS...]
  ip      print a host's underlay or a container's overlay address: ip [--name LAB] TARGET
  status  show the lab's hosts, containers, PIDs and health
  cni     print the CNI conflist a runtime on a lab host would use: cni [--name LAB] HOST

TARGET is a host (h1) or a container (h1/c2). Every command takes --name LAB (default ` + lab.DefaultName + `).`

func cmdLab(ctx context.Context, env Env, args []string) error {
	if len(args) == 0 {
		fmt.Fprintln(env.Stderr, labUsage)
		return exitError(2)
	}
	if isHelp(args[0]) {
		fmt.Fprintln(env.Stdout, labUsage)
		return nil
	}
	sub := map[string]func(context.Context, Env, []string) error{
		"up": labUp, "down": labDown, "exec": labExec, "ip": labIP, "status": labStatus, "cni": labCNI, "etcd-server": labEtcd,
	}[args[0]]
	if sub == nil {
		return usagef("unknown lab command %q (up, down, exec, ip, status, cni; skiff lab help)", args[0])
	}
	return sub(ctx, env, args[1:])
}

const labCNIUsage = "usage: skiff lab cni [--name LAB] HOST   (HOST: h1; prints the CNI conflist a runtime on HOST would use)"

// labCNI prints the conflist a runtime on a lab host would use.
func labCNI(_ context.Context, env Env, args []string) error {
	fs := flags(env, "lab cni")
	name := nameFlag(fs)
	usageLine(fs, labCNIUsage)
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return usagef("%s", labCNIUsage)
	}
	l, err := lab.Open(*name)
	if err != nil {
		return err
	}
	return printConfList(env, l, fs.Arg(0))
}

func printConfList(env Env, l *lab.Lab, host string) error {
	data, err := l.ConfList(host)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(env.Stdout, "%s\n", data)
	return err
}

func nameFlag(fs *flag.FlagSet) *string {
	return fs.String("name", lab.DefaultName, "lab name (several labs can run side by side under different names)")
}

func labUp(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "lab up")
	var cfg lab.Config
	fs.StringVar(&cfg.Name, "name", lab.DefaultName, "lab name")
	fs.IntVar(&cfg.Hosts, "hosts", 2, "number of hosts")
	fs.IntVar(&cfg.ContainersPerHost, "containers-per-host", 2, "containers on each host")
	fs.StringVar(&cfg.Mode, "mode", "auto", "data-plane mode: "+strings.Join(agent.Modes(), ", ")+" (auto: every layer the machine can run)")
	fs.IntVar(&cfg.UnderlayMTU, "underlay-mtu", 1500, "MTU of the underlay links")
	fs.StringVar(&cfg.ClusterCIDR, "cluster-cidr", "10.244.0.0/16", "overlay address range")
	fs.BoolVar(&cfg.EtcdInsecure, "etcd-insecure", false, "run the lab's store on plain HTTP without client certificates (default: TLS)")
	fs.IntVar(&cfg.EtcdMembers, "etcd-members", 1, "members of the lab's etcd cluster: 1, 3, 5 or 7 (2k+1 survive the loss of k)")
	fs.StringVar(&cfg.BinDir, "bin-dir", "", "directory holding skiffd and skiff-cni (default: next to skiff)")
	fs.BoolVar(&cfg.SlimRouters, "slim-routers", false, "run the Slim and SlimFast routers on every host (skiff bench's slim and slimfast modes)")
	agentArgs := fs.String("agent-args", "", "extra skiffd flags for every host, space-separated (e.g. \"--cache-tunnel rewrite\")")
	if err := parse(fs, args); err != nil {
		return err
	}
	cfg.AgentArgs = strings.Fields(*agentArgs)
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	start := time.Now()
	l, err := lab.Up(ctx, cfg)
	if err != nil {
		return err
	}
	fmt.Fprintf(env.Stdout, "lab %s up in %.1fs: %d hosts, %d containers, mode %s\n",
		l.Config.Name, time.Since(start).Seconds(), len(l.Hosts), len(l.Containers), l.Config.Mode)
	return printLab(env, l)
}

func printLab(env Env, l *lab.Lab) error {
	var rows [][]string
	for _, m := range l.Etcd {
		rows = append(rows, []string{m.Name, "etcd", m.IP.String(), m.Netns, fmt.Sprint(m.PID)})
	}
	for _, h := range l.Hosts {
		rows = append(rows, []string{h.Name, "host", h.UnderlayIP.String(), h.Netns, fmt.Sprint(h.AgentPID)})
		for _, c := range l.Containers {
			if c.Host == h.Name {
				rows = append(rows, []string{c.Name, "container", c.IP.String(), c.Netns, ""})
			}
		}
	}
	return table(env.Stdout, "TARGET\tKIND\tIP\tNETNS\tPID", rows)
}

func labDown(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "lab down")
	name := nameFlag(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	return lab.Down(ctx, *name)
}

func labExec(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "lab exec")
	name := nameFlag(fs)
	if err := parseLeading(fs, args); err != nil {
		return err
	}
	rest := fs.Args()
	if len(rest) > 1 && rest[1] == "--" {
		rest = append(rest[:1], rest[2:]...)
	}
	if len(rest) < 2 {
		return usagef("usage: skiff lab exec [--name LAB] TARGET -- COMMAND [ARGS...]   (TARGET: h1 or h1/c2)")
	}
	l, err := lab.Open(*name)
	if err != nil {
		return err
	}
	// SIGTERM and SIGINT are passed on, so the program ends with us and
	// never runs on in the lab unowned.
	ctx, stop := signalContext(ctx)
	defer stop()
	cmd, err := l.Command(ctx, rest[0], rest[1], rest[2:]...)
	if err != nil {
		return err
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = env.Stdin, env.Stdout, env.Stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 5 * time.Second // then it is killed
	err = cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return exitError(128 + int(ws.Signal())) // as a shell reports it
		}
		return exitError(ee.ExitCode())
	}
	return err
}

func labIP(_ context.Context, env Env, args []string) error {
	fs := flags(env, "lab ip")
	name := nameFlag(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return usagef("usage: skiff lab ip [--name LAB] TARGET   (TARGET: h1 or h1/c2)")
	}
	l, err := lab.Open(*name)
	if err != nil {
		return err
	}
	ip, err := l.IP(fs.Arg(0))
	if err != nil {
		return err
	}
	fmt.Fprintln(env.Stdout, ip)
	return nil
}

func labStatus(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "lab status")
	name := nameFlag(fs)
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	l, err := lab.Open(*name)
	if err != nil {
		return err
	}
	health := l.Healthy(ctx)
	if *asJSON {
		type status struct {
			*lab.Lab
			Healthy bool   `json:"healthy"`
			Problem string `json:"problem,omitempty"`
		}
		st := status{Lab: l, Healthy: health == nil}
		if health != nil {
			st.Problem = health.Error()
		}
		return printJSON(env.Stdout, st)
	}
	fmt.Fprintf(env.Stdout, "lab %s: mode %s, underlay MTU %d, cluster %s\n", l.Config.Name, l.Config.Mode, l.Config.UnderlayMTU, l.Config.ClusterCIDR)
	if health != nil {
		fmt.Fprintf(env.Stdout, "UNHEALTHY: %v\n", health)
	} else {
		fmt.Fprintln(env.Stdout, "healthy: every agent ready and in sync")
	}
	return printLab(env, l)
}

// labEtcd runs the lab's embedded etcd server (started by lab up inside the
// switch namespace).
func labEtcd(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "lab etcd-server")
	var cfg store.EmbeddedConfig
	fs.StringVar(&cfg.Dir, "dir", "", "data directory")
	fs.StringVar(&cfg.ClientURL, "listen", "", "client URL")
	fs.StringVar(&cfg.PeerURL, "peer", "", "peer URL")
	fs.StringVar(&cfg.Name, "name", "", "member name (default skiff)")
	fs.StringVar(&cfg.InitialCluster, "initial-cluster", "", "every member as NAME=PEER-URL,... (default: this one alone)")
	fs.StringVar(&cfg.PKIDir, "pki-dir", "", "directory of the cluster CA and certificates (default: DIR/pki)")
	fs.BoolVar(&cfg.Insecure, "etcd-insecure", false, "serve plain HTTP without client certificates")
	cfg.Log = slog.New(slog.NewTextHandler(env.Stderr, nil))
	if err := parse(fs, args); err != nil {
		return err
	}
	if cfg.Dir == "" || cfg.ClientURL == "" || cfg.PeerURL == "" {
		return usagef("--dir, --listen and --peer are required")
	}
	ctx, stop := signalContext(ctx)
	defer stop()
	e, err := store.StartEmbedded(ctx, cfg)
	if err != nil {
		return err
	}
	defer e.Close()
	fmt.Fprintln(env.Stderr, "etcd serving on", e.URL)
	select {
	case <-ctx.Done():
		return nil
	case err := <-e.Err():
		return err
	}
}
