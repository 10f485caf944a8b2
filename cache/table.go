package cache

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/bpfmap"
	"github.com/skiffnet/skiff/policy"
)

// The connection table (flows.h): flows the fast path carries from their
// first packet — TCP connections, UDP and ICMP echo pseudo-connections.
// This file keeps it coherent with the policy and ends flows idle past the
// timeouts conntrack would give them.

// Connection states, as enum flow_st in flows.h. UDP and ICMP flows are
// opened (stSynSent: by the local container; stSynRecv: by the other end),
// then replied (stEstablished).
const (
	stSynSent     = 1
	stSynRecv     = 2
	stEstablished = 3
	stClosing     = 4
)

// SyncPolicy compiles set for the local containers into the maps that judge
// a connection's SYN, and lets SYNs open connections only once the maps
// hold it: a policy that does not fit leaves every new connection to the
// overlay, which judges it by the same rules.
func (c *fastPath) SyncPolicy(set policy.Set, local []netip.Addr) error {
	if err := c.policy.Sync(set, local); err != nil {
		return errors.Join(fmt.Errorf("compile the policy for the fast path (new connections take the overlay): %w", err),
			c.setPolicy(false))
	}
	return c.setPolicy(true)
}

// AddPolicy compiles set (the last synced) for one more local container.
// With no valid policy compiled, nothing is: the next reconcile's sync
// compiles for every container.
func (c *fastPath) AddPolicy(set policy.Set, a netip.Addr) error {
	if c.ctl.Policy == 0 {
		return nil
	}
	if err := c.policy.Add(set, a); err != nil {
		return errors.Join(fmt.Errorf("compile the policy for %s (new connections take the overlay): %w", a, err),
			c.setPolicy(false))
	}
	return nil
}

// purgeConnections deletes the table's connections match selects.
func (c *fastPath) purgeConnections(match func(skcFlowKey, skcFlowState) bool) (int, error) {
	return purge(c.objs.SkcFlows, match)
}

// openedAgainst reports whether set denies a table flow the way it was
// opened: the overlay's conntrack would have let its replies through
// whatever the rules say of their direction, and so does the table.
func openedAgainst(set policy.Set, k skcFlowKey, s skcFlowState) bool {
	f := policy.Flow{Src: addr32(k.Laddr), Dst: addr32(k.Raddr), Proto: protoNames[k.Proto], Port: ntohs(k.Rport)}
	if s.Outbound == 0 {
		f = policy.Flow{Src: addr32(k.Raddr), Dst: addr32(k.Laddr), Proto: f.Proto, Port: ntohs(k.Lport)}
	}
	if k.Proto == unix.IPPROTO_ICMP {
		f.Port = 0 // the echo's identifier
	}
	return !set.Allowed(f)
}

// class is a table flow's protocol and state.
type class struct {
	proto, state uint8
}

// timeouts are conntrack's timeouts of this host, by protocol and table
// state: TCP's by state, UDP's unreplied and replied ("stream"), ICMP's.
func timeouts() map[class]time.Duration {
	read := func(name string, def time.Duration) time.Duration {
		b, err := os.ReadFile("/proc/sys/net/netfilter/nf_conntrack_" + name)
		if err != nil {
			return def
		}
		s, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || s <= 0 {
			return def
		}
		return time.Duration(s) * time.Second
	}
	udp, stream, icmp := read("udp_timeout", 30*time.Second), read("udp_timeout_stream", 120*time.Second), read("icmp_timeout", 30*time.Second)
	return map[class]time.Duration{
		{unix.IPPROTO_TCP, stSynSent}:      read("tcp_timeout_syn_sent", 120*time.Second),
		{unix.IPPROTO_TCP, stSynRecv}:      read("tcp_timeout_syn_recv", 60*time.Second),
		{unix.IPPROTO_TCP, stEstablished}:  read("tcp_timeout_established", 5*24*time.Hour),
		{unix.IPPROTO_TCP, stClosing}:      read("tcp_timeout_fin_wait", 120*time.Second),
		{unix.IPPROTO_UDP, stSynSent}:      udp,
		{unix.IPPROTO_UDP, stSynRecv}:      udp,
		{unix.IPPROTO_UDP, stEstablished}:  stream,
		{unix.IPPROTO_ICMP, stSynSent}:     icmp,
		{unix.IPPROTO_ICMP, stSynRecv}:     icmp,
		{unix.IPPROTO_ICMP, stEstablished}: icmp,
	}
}

// monotonicCoarse is bpf_ktime_get_coarse_ns()'s clock.
func monotonicCoarse() (uint64, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts); err != nil {
		return 0, fmt.Errorf("read the monotonic clock: %w", err)
	}
	return uint64(ts.Nano()), nil
}

// expire ends the table's flows idle past their timeout (a peer that
// vanished, a SYN never answered, a UDP flow gone quiet). The programs
// refresh a flow's time once a second, so the margin covers it.
func (c *fastPath) expire() (int, error) {
	now, err := monotonicCoarse()
	if err != nil {
		return 0, err
	}
	limits := timeouts()
	return c.purgeConnections(func(k skcFlowKey, s skcFlowState) bool {
		limit, ok := limits[class{k.Proto, s.State}]
		if !ok {
			return true // not a state the programs write
		}
		return s.Seen < now && time.Duration(now-s.Seen) > limit+2*time.Second
	})
}

// maintain runs expire and refreshes the remote hosts' headers until
// ctx ends.
func (c *fastPath) maintain(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			c.refreshHeaders()
			n, err := c.expire()
			if err != nil {
				c.log.Warn("expire idle fast-path connections", "err", err)
			} else if n > 0 {
				c.log.Debug("expired idle fast-path connections", "connections", n)
			}
			if n, err := c.sweepKeys(); err != nil {
				c.log.Warn("free the rewriting tunnel's dead keys", "err", err)
			} else if n > 0 {
				c.log.Debug("freed dead tunnel keys", "keys", n)
			}
		}
	}
}

// Connections counts the table's flows by protocol and state.
func (c *fastPath) Connections() (map[class]int, error) {
	all, err := bpfmap.Entries[skcFlowKey, skcFlowState](c.objs.SkcFlows)
	if err != nil {
		return nil, fmt.Errorf("walk the connection table: %w", err)
	}
	n := map[class]int{}
	for k, s := range all {
		n[class{k.Proto, s.State}]++
	}
	return n, nil
}
