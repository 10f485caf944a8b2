// Package cli is the skiff command: status, endpoints, hosts, policies, the
// lab and the benchmark. Commands take an Env so tests run them in-process.
package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/bench/scale"
	"github.com/skiffnet/skiff/lab"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/store"
	"github.com/skiffnet/skiff/version"
)

// Env is what a command sees of the world.
type Env struct {
	Args           []string
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	Getenv         func(string) string
}

// exitError carries an exit code without printing anything more.
type exitError int

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// usageError is a mistake in how the command was called (exit code 2).
type usageError struct{ error }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

type command struct {
	summary string
	run     func(ctx context.Context, env Env, args []string) error
	hidden  bool
}

var commands map[string]command

func init() {
	commands = map[string]command{
		"status":          {summary: "show this host's agent, store and data plane", run: cmdStatus},
		"endpoints":       {summary: "list container endpoints (--all: of every host)", run: cmdEndpoints},
		"hosts":           {summary: "list hosts; hosts remove NAME takes one out of the cluster", run: cmdHosts},
		"policy":          {summary: "policy add|del|list: allow/deny rules for new flows", run: cmdPolicy},
		"limit":           {summary: "limit set|del|list: containers' rate limits, changed while they run", run: cmdLimit},
		"lab":             {summary: "lab up|down|exec|ip|status|cni: an emulated cluster on this machine", run: cmdLab},
		"layer":           {summary: "layer NAME: one running layer at length (skiff NAME too: skiff cache shows its entries)", run: cmdLayer},
		"seccomp-profile": {summary: "print the seccomp profile that gives unmodified images host sockets (sockets layer)", run: cmdSeccompProfile},
		"cert":            {summary: "cert issue: an etcd client certificate for another host (or the administrator)", run: cmdCert},
		"bench":           {summary: "measure every data-plane mode against the host network", run: cmdBench},
		"doctor":          {summary: "what this host has and lacks for skiff and each layer, with the fix", run: cmdDoctor},
		"scale-flows": {summary: "a worker process of skiff bench --scale (flows)", hidden: true, run: func(ctx context.Context, env Env, args []string) error {
			return scale.Worker(ctx, args, env.Stdin, env.Stdout)
		}},
		"slim-router": {summary: "a Slim or SlimFast router of skiff bench's slim and slimfast modes", hidden: true, run: cmdSlimRouter},
		"uninstall":   {summary: "remove skiff from this host: what skiffd made (skiffd --cleanup), then make install's files", run: cmdUninstall},
		"version": {summary: "print the version", run: func(_ context.Context, env Env, _ []string) error {
			fmt.Fprintln(env.Stdout, "skiff", version.String())
			return nil
		}},
	}
}

// Run runs the skiff command line and returns the process exit code.
func Run(ctx context.Context, env Env) int {
	if env.Getenv == nil {
		env.Getenv = os.Getenv
	}
	err := dispatch(ctx, env)
	var ee exitError
	var ue usageError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return int(ee)
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &ue):
		fmt.Fprintln(env.Stderr, "skiff:", err)
		return 2
	default:
		fmt.Fprintln(env.Stderr, "skiff:", err)
		return 1
	}
}

// isHelp reports whether arg asks for help.
func isHelp(arg string) bool {
	return arg == "help" || arg == "-h" || arg == "-help" || arg == "--help"
}

func dispatch(ctx context.Context, env Env) error {
	if len(env.Args) == 2 && env.Args[0] == "help" {
		if _, ok := commands[env.Args[1]]; ok { // skiff help COMMAND
			env.Args = []string{env.Args[1], "--help"}
		}
	}
	if len(env.Args) == 0 || isHelp(env.Args[0]) {
		usage(env.Stdout)
		return nil
	}
	c, ok := commands[env.Args[0]]
	why := ""
	if !ok && !strings.HasPrefix(env.Args[0], "-") {
		// skiff NAME for a layer the agent runs: skiff layer NAME.
		err := cmdLayer(ctx, Env{Stdout: env.Stdout, Stderr: io.Discard, Getenv: env.Getenv, Args: env.Args}, append(env.Args[1:], env.Args[0]))
		var ae *api.Error
		var ue usageError
		switch {
		case errors.Is(err, api.ErrAgentUnreachable):
			why = " (nor a layer's: skiffd is not reachable to ask)"
		case errors.As(err, &ae):
			why = " (nor a running layer: " + ae.Message + ")"
		case !errors.As(err, &ue):
			return err // nil: it was a layer
		}
	}
	if !ok {
		usage(env.Stderr)
		return usagef("unknown command %q%s", env.Args[0], why)
	}
	return c.run(ctx, env, env.Args[1:])
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "skiff: a container overlay network as fast as the host network\n\nusage: skiff COMMAND [flags]\n\ncommands:")
	names := make([]string, 0, len(commands))
	for n, c := range commands {
		if !c.hidden {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-10s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nAgent commands talk to skiffd on --socket (or $SKIFF_SOCKET, default "+api.DefaultSocket+");\nwith no agent there but a lab up, they talk to the lab's first host.")
}

// flags returns a flag set that reports errors as usage errors.
func flags(env Env, name string) *flag.FlagSet {
	fs := flag.NewFlagSet("skiff "+name, flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	return fs
}

// parse parses args with flags anywhere among the positional arguments,
// up to a "--" (which stays among them when it follows one).
func parse(fs *flag.FlagSet, args []string) error { return parseArgs(fs, args, true) }

// parseLeading parses the flags before the first positional argument only:
// for commands whose positional arguments are a command line or a rule.
func parseLeading(fs *flag.FlagSet, args []string) error { return parseArgs(fs, args, false) }

func parseArgs(fs *flag.FlagSet, args []string, anywhere bool) error {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return err
			}
			return usageError{err}
		}
		rest := fs.Args()
		n := len(args) - len(rest)
		dashes := n > 0 && args[n-1] == "--"
		if !anywhere || len(rest) == 0 || dashes {
			if dashes && len(pos) > 0 {
				pos = append(pos, "--")
			}
			pos = append(pos, rest...)
			break
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
	fs.Parse(append([]string{"--"}, pos...)) // fs.Args() is pos
	if fs.NArg() > 0 && isHelp(fs.Arg(0)) {  // skiff COMMAND help
		fs.Usage()
		return flag.ErrHelp
	}
	return nil
}

// usageLine makes fs's help start with line.
func usageLine(fs *flag.FlagSet, line string) {
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), line)
		fs.PrintDefaults()
	}
}

// socketFlag adds --socket and returns a function giving the client.
func socketFlag(env Env, fs *flag.FlagSet) func() *api.Client {
	sock := fs.String("socket", "", "skiffd API socket")
	return func() *api.Client {
		switch {
		case *sock != "":
			return api.NewClient(*sock)
		case env.Getenv("SKIFF_SOCKET") != "":
			return api.NewClient(env.Getenv("SKIFF_SOCKET"))
		}
		if _, err := os.Stat(api.DefaultSocket); err != nil {
			for _, name := range lab.List() {
				if l, err := lab.Open(name); err == nil && len(l.Hosts) > 0 {
					fmt.Fprintf(env.Stderr, "(no agent at %s; using lab %s host %s)\n", api.DefaultSocket, name, l.Hosts[0].Name)
					return api.NewClient(l.Hosts[0].Socket)
				}
			}
		}
		return api.NewClient(api.DefaultSocket)
	}
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func table(w io.Writer, header string, rows [][]string) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	return tw.Flush()
}

func cmdStatus(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "status")
	client := socketFlag(env, fs)
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	st, err := client().Status(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(env.Stdout, st)
	}
	w := env.Stdout
	fmt.Fprintf(w, "host:       %s (underlay %s, VTEP MAC %s)\n", st.Host.Name, st.Host.UnderlayIP, st.Host.VTEPMAC)
	fmt.Fprintf(w, "subnet:     %s of cluster %s (VNI %d, UDP port %d)\n", st.Host.Subnet, st.Cluster.CIDR, st.Cluster.VNI, st.Cluster.VXLANPort)
	fmt.Fprintf(w, "mode:       %s\n", st.Mode)
	fmt.Fprintf(w, "layers:     overlay on")
	for _, l := range st.Layers {
		if l.On {
			fmt.Fprintf(w, ", %s on", l.Name)
		}
	}
	fmt.Fprintln(w)
	for _, l := range st.Layers {
		if !l.On {
			fmt.Fprintf(w, "            %s off — %s\n", l.Name, l.Reason)
		}
	}
	store := "reachable"
	if !st.StoreReachable {
		store = "UNREACHABLE: " + st.StoreError
	}
	fmt.Fprintf(w, "store:      %s\n", store)
	fmt.Fprintf(w, "ready:      %v (last sync %s)\n", st.Ready, st.LastSync.Format("15:04:05.000"))
	fmt.Fprintf(w, "reconciles: %d (%d store events folded into later ones)\n", st.Reconciles, st.ReconcileEventsHeld)
	if st.SyncError != "" {
		fmt.Fprintf(w, "sync error: %s\n", st.SyncError)
	}
	fmt.Fprintf(w, "endpoints:  %d local; %d remote hosts\n", st.Endpoints, st.RemoteHosts)
	if len(st.Maps) > 0 {
		fmt.Fprintf(w, "maps:       %s\n", mapsLine(st.Maps))
	}
	if st.SourceDrops != nil {
		var rows [][]string
		for _, r := range overlay.SourceReasons() {
			if n := st.SourceDrops[r]; n > 0 {
				rows = append(rows, []string{"  " + r, fmt.Sprint(n)})
			}
		}
		fmt.Fprintln(w, "source check (dropped packets):")
		table(w, "  REASON\tPACKETS", rows)
	}
	if len(st.PolicyDenies) > 0 {
		var rows [][]string
		for _, id := range slices.Sorted(maps.Keys(st.PolicyDenies)) {
			rows = append(rows, []string{"  " + id, fmt.Sprint(st.PolicyDenies[id])})
		}
		fmt.Fprintln(w, "policy (denied packets, by rule):")
		table(w, "  RULE\tPACKETS", rows)
	}
	for _, l := range st.Layers {
		if l.On {
			printView(w, l.View)
		}
	}
	if len(st.QoS) > 0 {
		fmt.Fprintf(w, "QoS: %d underlay packets of classed containers marked, %d of normal ones\n", st.QoS["marked"], st.QoS["unclassed"])
	}
	return nil
}

func cmdEndpoints(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "endpoints")
	client := socketFlag(env, fs)
	all := fs.Bool("all", false, "endpoints of every host")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := parse(fs, args); err != nil {
		return err
	}
	eps, err := client().Endpoints(ctx, *all)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(env.Stdout, eps)
	}
	var rows [][]string
	for _, e := range eps {
		// Only its own host's agent knows another host's endpoint's layers.
		path, why := "-", "-"
		if on, off := e.Paths(); e.Layers != nil {
			path, why = strings.Join(append(on, "overlay"), ","), cmp.Or(strings.Join(off, "; "), "-")
		}
		rows = append(rows, []string{e.Host, e.ContainerID, e.IfName, e.IP.String(), e.Veth, e.MAC, path, why})
	}
	return table(env.Stdout, "HOST\tCONTAINER\tIF\tIP\tVETH\tMAC\tLAYERS\tOFF FOR IT", rows)
}

const hostsUsage = "usage: skiff hosts [--json] [remove NAME]"

func cmdHosts(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "hosts")
	client := socketFlag(env, fs)
	admin := adminStore(env, fs)
	asJSON := fs.Bool("json", false, "print JSON")
	usageLine(fs, hostsUsage)
	if err := parse(fs, args); err != nil {
		return err
	}
	switch rest := fs.Args(); {
	case len(rest) == 2 && rest[0] == "remove":
		return removeHost(ctx, admin, rest[1])
	case len(rest) != 0:
		return usagef(hostsUsage)
	}
	hosts, err := client().Hosts(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(env.Stdout, hosts)
	}
	var rows [][]string
	for _, h := range hosts {
		rows = append(rows, []string{h.Name, h.UnderlayIP.String(), h.Subnet.String(), h.VTEPMAC})
	}
	return table(env.Stdout, "NAME\tUNDERLAY\tSUBNET\tVTEP MAC", rows)
}

const policyUsage = "usage: skiff policy add ID allow|deny [priority N] [from PREFIX] [to PREFIX] [proto tcp|udp|icmp] [port N[-M]] | del ID | list"

func cmdPolicy(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "policy")
	client := socketFlag(env, fs)
	admin := adminStore(env, fs)
	usageLine(fs, policyUsage)
	if err := parseLeading(fs, args); err != nil {
		return err
	}
	rest := fs.Args()
	if len(rest) == 0 {
		return usagef(policyUsage)
	}
	switch rest[0] {
	case "add":
		r, err := policy.ParseRule(rest[1:])
		if err != nil {
			return usageError{err}
		}
		return withStore(admin, func(s *store.Store) error { return s.PutPolicy(ctx, r) })
	case "del", "delete", "rm":
		if len(rest) != 2 {
			return usagef("usage: skiff policy del ID")
		}
		return withStore(admin, func(s *store.Store) error { return s.DeletePolicy(ctx, rest[1]) })
	case "list", "ls":
		set, err := client().Policies(ctx)
		if err != nil {
			return err
		}
		for _, r := range set {
			fmt.Fprintln(env.Stdout, r)
		}
		return nil
	}
	return usagef("unknown policy command %q (add, del, list)", rest[0])
}

// withStore runs f with the store open returns.
func withStore(open func() (*store.Store, error), f func(*store.Store) error) error {
	s, err := open()
	if err != nil {
		return err
	}
	defer s.Close()
	return f(s)
}

// removeHost deletes a host's keys and, where the store checks its
// clients, its user and role: its certificate writes nothing any more.
func removeHost(ctx context.Context, admin func() (*store.Store, error), name string) error {
	return withStore(admin, func(s *store.Store) error {
		return errors.Join(s.RemoveHost(ctx, name), s.RevokeHost(ctx, name))
	})
}

// mapsLine is the fullest of the host's maps, and every one at least
// 80 % full but the LRU maps, which fill by design (docs/maps.md says
// what a full one does).
func mapsLine(use []api.MapUse) string {
	share := func(u api.MapUse) float64 { return float64(u.Entries) / float64(max(u.Capacity, 1)) }
	fullest := slices.MaxFunc(use, func(a, b api.MapUse) int { return cmp.Compare(share(a), share(b)) })
	line := fmt.Sprintf("%d counted, fullest %s (%d of %d)", len(use), fullest.Name, fullest.Entries, fullest.Capacity)
	for _, u := range use {
		if share(u) >= 0.8 && !strings.HasPrefix(u.Type, "LRU") {
			line += fmt.Sprintf("; NEARLY FULL: %s %d of %d", u.Name, u.Entries, u.Capacity)
		}
	}
	return line
}
