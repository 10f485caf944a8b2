package cli

import (
	"context"
	"log/slog"
	"net/netip"

	"github.com/skiffnet/skiff/slim"
)

// cmdSlimRouter runs one of the papers' routers (package slim) on a lab
// host, for skiff bench's slim and slimfast modes.
func cmdSlimRouter(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "slim-router")
	design := fs.String("design", slim.DesignSlim, "slim or slimfast")
	socket := fs.String("socket", "", "the Unix socket shims reach the router on")
	agent := fs.String("agent-socket", "", "the host's skiffd API socket: its underlay address and the cluster's hosts")
	hostIP := fs.String("host-ip", "", "this host's underlay address (default: the agent's)")
	port := fs.Int("port", slim.DefaultPort, "SlimFast's router port on every host")
	relay := fs.Int("relay-port", slim.DefaultRelayPort, "SlimFast's UDP relay port on every host")
	allOn := fs.String("all-on", "", "TEST ONLY: every overlay address lives on this host address (no agent)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *socket == "" {
		return usagef("slim-router needs --socket")
	}
	log := slog.New(slog.NewTextHandler(env.Stderr, nil))
	o := slim.Options{Design: *design, Socket: *socket, Port: *port, RelayPort: *relay, Log: log,
		Lookup: func(netip.Addr) (netip.Addr, bool) { return netip.Addr{}, false }}
	if *agent != "" {
		host, lookup, err := slim.FromAgent(ctx, *agent, log)
		if err != nil {
			return err
		}
		o.HostIP, o.Lookup = host, lookup
	}
	if *hostIP != "" {
		a, err := netip.ParseAddr(*hostIP)
		if err != nil {
			return usagef("--host-ip: %v", err)
		}
		o.HostIP = a
	}
	if *allOn != "" {
		a, err := netip.ParseAddr(*allOn)
		if err != nil {
			return usagef("--all-on: %v", err)
		}
		o.Lookup = func(netip.Addr) (netip.Addr, bool) { return a, true }
	}
	return slim.Run(ctx, o)
}
