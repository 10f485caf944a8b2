package agent

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"time"

	"github.com/skiffnet/skiff/overlay"
)

// etcdPeerPort is where etcd members talk to each other unless told
// otherwise; the guard keeps containers from it on every store address.
const etcdPeerPort = 2380

// controlPlane is what the overlay's guard keeps containers from: the
// store's client endpoints and the peer port on the same addresses, and
// what this host serves (its embedded etcd, its metrics) on any of its
// addresses.
func controlPlane(ctx context.Context, endpoints []string, served []netip.AddrPort) (overlay.ControlPlane, error) {
	var cp overlay.ControlPlane
	for _, e := range served {
		cp.Ports = append(cp.Ports, e.Port())
	}
	for _, e := range endpoints {
		addrs, port, err := resolveEndpoint(ctx, e)
		if err != nil {
			return cp, err
		}
		cp.Ports = append(cp.Ports, port, etcdPeerPort)
		for _, a := range addrs {
			cp.Endpoints = append(cp.Endpoints, netip.AddrPortFrom(a, port), netip.AddrPortFrom(a, etcdPeerPort))
		}
	}
	return cp, nil
}

// resolveEndpoint returns the IPv4 addresses and the port of an etcd
// client URL (or host:port).
func resolveEndpoint(ctx context.Context, endpoint string) ([]netip.Addr, uint16, error) {
	if endpoint == "" {
		return nil, 0, fmt.Errorf("empty endpoint")
	}
	hostport := endpoint
	if u, err := url.Parse(endpoint); err == nil && u.Host != "" {
		hostport = u.Host
	}
	host, p, err := net.SplitHostPort(hostport)
	if err != nil {
		host, p = hostport, "2379"
	}
	port, err := strconv.ParseUint(p, 10, 16)
	if err != nil {
		return nil, 0, fmt.Errorf("etcd endpoint %q: port %q: %w", endpoint, p, err)
	}
	if host == "" {
		return []netip.Addr{netip.IPv4Unspecified()}, uint16(port), nil
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if a.IsUnspecified() {
			a = netip.IPv4Unspecified()
		}
		return []netip.Addr{a.Unmap()}, uint16(port), nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupNetIP(ctx, "ip4", host)
	if err != nil {
		return nil, 0, fmt.Errorf("etcd endpoint %q: resolve %s: %w", endpoint, host, err)
	}
	return addrs, uint16(port), nil
}
