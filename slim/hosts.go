package slim

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
)

// FromAgent waits for the local agent to be ready and returns this host's
// underlay address and a Lookup that follows the cluster's hosts through
// the agent (refreshed every second until ctx ends): SlimFast's table of
// which host holds which overlay subnet, written ahead of connections and
// kept current in the background (§IV-C).
func FromAgent(ctx context.Context, socket string, log *slog.Logger) (netip.Addr, func(netip.Addr) (netip.Addr, bool), error) {
	c := api.NewClient(socket)
	var host netip.Addr
	for {
		st, err := c.Status(ctx)
		if err == nil && st.Ready {
			host = st.Host.UnderlayIP
			break
		}
		select {
		case <-ctx.Done():
			return netip.Addr{}, nil, fmt.Errorf("slim router: the agent at %s is not ready: %w", socket, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	var hosts atomic.Pointer[[]cluster.Host]
	refresh := func() {
		hs, err := c.Hosts(ctx)
		if err != nil {
			log.Warn("slim router: read the hosts", "err", err)
			return
		}
		hosts.Store(&hs)
	}
	refresh()
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				refresh()
			}
		}
	}()
	return host, func(a netip.Addr) (netip.Addr, bool) {
		hs := hosts.Load()
		if hs == nil {
			return netip.Addr{}, false
		}
		for _, h := range *hs {
			if h.Subnet.Contains(a) {
				return h.UnderlayIP, true
			}
		}
		return netip.Addr{}, false
	}, nil
}
