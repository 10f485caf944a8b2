// Package overlay is skiff's standard VXLAN overlay, the data path every
// faster layer falls back to. Its design is Flannel's: per host a bridge whose
// address is the gateway of the host subnet, one VXLAN device with learning
// off, and for every remote host an onlink route, a permanent neighbour entry
// and an FDB entry — no miss handling, state linear in the number of hosts,
// and nothing that needs the agent to be running to forward packets.
package overlay

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/limits"
	"github.com/skiffnet/skiff/netlinksafe"
	"github.com/skiffnet/skiff/policy"
)

// Names of the devices skiff owns on a host.
const (
	BridgeName = "skiff0"
	VXLANName  = "skiff.vxlan"
	VethPrefix = "skf"
	// Overhead is what VXLAN over IPv4 adds to a frame: outer IPv4 (20), UDP
	// (8), VXLAN (8) and the inner Ethernet header (14).
	Overhead = 50
)

// Config describes the host the overlay is built on.
type Config struct {
	Cluster  cluster.Config
	Host     cluster.Host // this host, with its subnet and VTEP MAC
	Underlay string       // name of the interface that carries Host.UnderlayIP
	PinDir   string       // bpffs directory for the source check's and QoS's maps and links
	// UnderlayRate, when set, shapes the underlay (bit/s) so that QoS
	// classes keep their shares under contention (limits.QoS).
	UnderlayRate uint64
	// FullMTU gives containers the underlay's MTU: a layer carries their
	// packets between hosts without VXLAN's Overhead (the cache's
	// rewriting tunnel). What the overlay itself carries beyond
	// underlay − Overhead leaves in two outer IPv4 fragments (the VXLAN
	// device sends no DF), and the routes to other hosts' subnets lock
	// their MTU, so that the device never turns a packet it carries into
	// an ICMP "fragmentation needed" for the container.
	FullMTU bool
}

// Overlay manages one host's part of the overlay.
type Overlay struct {
	cfg      Config
	underlay netlink.Link
	mtu      int
	log      *slog.Logger
	applied  *policy.Set       // the rule set last enforced, nil before the first
	guard    string            // the guard chains last written
	written  map[string]string // the policy chains last written (writeChains)
	src      *sourceCheck
	qos      *limits.QoS
	police   *limits.Police
	// shaped is the rate limit SyncLimits last applied to each local
	// endpoint (container ID/interface), limitErrs why it could not.
	shaped    map[string]cluster.Limit
	limitErrs map[string]string
	repaired  time.Time // when SyncLimits last checked every limit's qdiscs
}

// New looks up the underlay interface; it changes nothing.
func New(cfg Config, log *slog.Logger) (*Overlay, error) {
	l, err := netlink.LinkByName(cfg.Underlay)
	if err != nil {
		return nil, fmt.Errorf("underlay interface %q: %w", cfg.Underlay, err)
	}
	mtu := l.Attrs().MTU - Overhead
	if cfg.FullMTU {
		mtu = l.Attrs().MTU
	}
	if mtu < 576 {
		return nil, fmt.Errorf("underlay %s MTU %d leaves %d for containers, below the IPv4 minimum of 576", cfg.Underlay, l.Attrs().MTU, mtu)
	}
	return &Overlay{cfg: cfg, underlay: l, mtu: mtu, log: log}, nil
}

// Close releases this process's handles on the source check; its pinned
// maps and links stay, and so does everything else the overlay built.
func (o *Overlay) Close() error {
	var errs []error
	if o.src != nil {
		errs = append(errs, o.src.objs.Close())
	}
	if o.qos != nil {
		errs = append(errs, o.qos.Close())
	}
	if o.police != nil {
		errs = append(errs, o.police.Close())
	}
	return errors.Join(errs...)
}

// MTU is the container interface MTU: the underlay's minus the VXLAN
// overhead, or the underlay's (Config.FullMTU).
func (o *Overlay) MTU() int { return o.mtu }

// VTEPMAC derives a host's VXLAN device MAC from its underlay address, so the
// MAC is stable across agent restarts and device re-creation. 0e is a locally
// administered unicast first octet.
func VTEPMAC(underlay netip.Addr) net.HardwareAddr {
	b := underlay.As4()
	return net.HardwareAddr{0x0e, 0x5f, b[0], b[1], b[2], b[3]}
}

// BridgeMAC is the bridge's address on a host. Fixed (a bridge otherwise
// takes its lowest port's address, which changes as containers come and
// go), so that frames the sockets layer readdresses to the host stack stay
// addressed right.
func BridgeMAC(underlay netip.Addr) net.HardwareAddr {
	b := underlay.As4()
	return net.HardwareAddr{0x0e, 0x5e, b[0], b[1], b[2], b[3]}
}

// VethName is the host-side veth name of a container interface: stable, short
// enough for IFNAMSIZ, and recognisably skiff's.
func VethName(containerID, ifName string) string {
	sum := sha256.Sum256([]byte(containerID + "/" + ifName))
	return VethPrefix + hex.EncodeToString(sum[:4])
}

// UnderlayAddr returns the first IPv4 address and prefix of interface name.
func UnderlayAddr(name string) (netip.Prefix, error) {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("underlay interface %q: %w", name, err)
	}
	addrs, err := netlink.AddrList(l, netlink.FAMILY_V4)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("addresses of %s: %w", name, err)
	}
	for _, a := range addrs {
		ip, _ := netip.AddrFromSlice(a.IP.To4())
		ones, _ := a.Mask.Size()
		return netip.PrefixFrom(ip, ones), nil
	}
	return netip.Prefix{}, fmt.Errorf("underlay interface %s has no IPv4 address", name)
}

// Setup creates or repairs the host's bridge and VXLAN device and the policy
// chains, and loads the containers' source check. It is idempotent: on an
// intact host it changes nothing, so an agent restart does not disturb
// traffic.
func (o *Overlay) Setup() error {
	if err := writeSysctl("net/ipv4/ip_forward", "1"); err != nil {
		return err
	}
	if o.src == nil {
		if o.cfg.PinDir == "" {
			return errors.New("overlay: no bpffs directory for the source check")
		}
		src, err := loadSourceCheck(o.cfg.PinDir, o.log)
		if err != nil {
			return err
		}
		o.src = src
	}
	if o.qos == nil {
		q, err := limits.LoadQoS(o.cfg.PinDir, o.underlay, uint16(o.cfg.Cluster.VXLANPort), o.log)
		if err != nil {
			return err
		}
		o.qos = q
	}
	if o.police == nil {
		p, err := limits.LoadPolice(o.cfg.PinDir, o.log)
		if err != nil {
			return err
		}
		o.police = p
	}
	if err := o.qos.ShapeUnderlay(o.cfg.UnderlayRate); err != nil {
		return err
	}
	if err := o.setupBridge(); err != nil {
		return err
	}
	if err := o.SyncBridgeNetfilter(); err != nil {
		return err
	}
	if err := o.setupVXLAN(); err != nil {
		return err
	}
	if err := o.setupChains(); err != nil {
		return err
	}
	return o.setupGuard()
}

// bridgeNetfilter is the sysctl that passes bridged IPv4 packets through
// iptables (br_netfilter; per network namespace): without it, the policy
// chain never sees traffic between two containers of this host.
const bridgeNetfilter = "net/bridge/bridge-nf-call-iptables"

// SyncBridgeNetfilter makes sure bridged packets pass iptables, so that
// the policy holds between containers of one host: it sets the sysctl,
// and says so when someone had turned it off. Without br_netfilter skiff
// cannot enforce that policy and refuses (skiff doctor says how to load
// it).
func (o *Overlay) SyncBridgeNetfilter() error {
	cur, err := os.ReadFile("/proc/sys/" + bridgeNetfilter)
	if errors.Is(err, os.ErrNotExist) {
		return errors.New("br_netfilter is not loaded: the policy between containers of one host needs it (modprobe br_netfilter; skiff doctor)")
	} else if err != nil {
		return fmt.Errorf("read %s: %w", bridgeNetfilter, err)
	}
	if v := strings.TrimSpace(string(cur)); v != "1" {
		if o.log != nil {
			o.log.Warn("bridged packets did not pass iptables (the policy between containers of this host did not hold); set again",
				"sysctl", strings.ReplaceAll(bridgeNetfilter, "/", "."), "was", v)
		}
		return writeSysctl(bridgeNetfilter, "1")
	}
	return nil
}

func writeSysctl(key, val string) error {
	p := "/proc/sys/" + key
	if cur, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(cur)) == val {
		return nil
	}
	if err := os.WriteFile(p, []byte(val), 0o644); err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", key, val, err)
	}
	return nil
}

func (o *Overlay) setupBridge() error {
	mac := BridgeMAC(o.cfg.Host.UnderlayIP)
	br, err := ensureLink(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: BridgeName, MTU: o.mtu, HardwareAddr: mac}}, func(l netlink.Link) bool {
		_, ok := l.(*netlink.Bridge)
		return ok
	})
	if err != nil {
		return err
	}
	if br.Attrs().HardwareAddr.String() != mac.String() { // made by an older skiff
		if err := netlink.LinkSetHardwareAddr(br, mac); err != nil {
			return fmt.Errorf("set %s address: %w", BridgeName, err)
		}
	}
	gw := netip.PrefixFrom(cluster.Gateway(o.cfg.Host.Subnet), o.cfg.Host.Subnet.Bits())
	if err := ensureOnlyAddr(br, gw); err != nil {
		return err
	}
	// The overlay is IPv4: without an IPv6 address on the bridge,
	// containers cannot reach the host's services by its link-local address
	// (which the IPv4 guard would not see).
	if _, err := os.Stat("/proc/sys/net/ipv6/conf/" + BridgeName); err == nil {
		if err := writeSysctl("net/ipv6/conf/"+BridgeName+"/disable_ipv6", "1"); err != nil {
			return err
		}
	}
	return ensureUpMTU(br, o.mtu)
}

func (o *Overlay) setupVXLAN() error {
	c := o.cfg
	// A VXLAN device bound to the underlay device may not exceed its MTU
	// less the Overhead: at the full MTU the device is bound to the local
	// address alone (the route to each host picks the device).
	dev, devArgs := o.underlay.Attrs().Index, []string{"dev", o.cfg.Underlay}
	if c.FullMTU {
		dev, devArgs = 0, nil
	}
	vx, err := netlink.LinkByName(VXLANName)
	have, ok := vx.(*netlink.Vxlan)
	switch {
	case err == nil && ok && have.VxlanId == c.Cluster.VNI && have.Port == c.Cluster.VXLANPort &&
		have.VtepDevIndex == dev && net.IP(have.SrcAddr).Equal(c.Host.UnderlayIP.AsSlice()) &&
		!have.Learning && !have.UDPCSum:
		// Intact: keep it (and the traffic on it).
	case err == nil:
		if err := netlink.LinkDel(vx); err != nil {
			return fmt.Errorf("replace mis-configured %s: %w", VXLANName, err)
		}
		fallthrough
	default:
		// Through ip(8): the netlink library cannot ask for zero UDP checksums
		// (it omits IFLA_VXLAN_UDP_CSUM=0, and the kernel's default is on).
		// Zero checksums are what the cache layer's fast path sends too.
		args := append([]string{"link", "add", VXLANName, "type", "vxlan", "id", fmt.Sprint(c.Cluster.VNI),
			"dstport", fmt.Sprint(c.Cluster.VXLANPort), "local", c.Host.UnderlayIP.String()}, devArgs...)
		out, err := exec.Command("ip", append(args, "nolearning", "noudpcsum")...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("create %s: %w: %s", VXLANName, err, strings.TrimSpace(string(out)))
		}
		if vx, err = netlink.LinkByName(VXLANName); err != nil {
			return fmt.Errorf("%s: %w", VXLANName, err)
		}
	}
	mac := VTEPMAC(c.Host.UnderlayIP)
	if vx.Attrs().HardwareAddr.String() != mac.String() {
		if err := netlink.LinkSetHardwareAddr(vx, mac); err != nil {
			return fmt.Errorf("set %s MAC: %w", VXLANName, err)
		}
	}
	if err := ensureOnlyAddr(vx, netip.PrefixFrom(cluster.VTEPAddr(c.Host.Subnet), 32)); err != nil {
		return err
	}
	return ensureUpMTU(vx, o.mtu)
}

// ensureLink returns the link named like want if it exists and ok accepts it;
// otherwise it (re)creates it.
func ensureLink(want netlink.Link, ok func(netlink.Link) bool) (netlink.Link, error) {
	name := want.Attrs().Name
	l, err := netlink.LinkByName(name)
	if err == nil && ok(l) {
		return l, nil
	}
	if err == nil {
		if err := netlink.LinkDel(l); err != nil {
			return nil, fmt.Errorf("replace mis-configured %s: %w", name, err)
		}
	} else if !errors.As(err, &netlink.LinkNotFoundError{}) {
		return nil, fmt.Errorf("look up %s: %w", name, err)
	}
	if err := netlink.LinkAdd(want); err != nil {
		return nil, fmt.Errorf("create %s: %w", name, err)
	}
	return netlink.LinkByName(name)
}

func ensureOnlyAddr(l netlink.Link, p netip.Prefix) error {
	want := &netlink.Addr{IPNet: prefixNet(p)}
	addrs, err := netlink.AddrList(l, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("addresses of %s: %w", l.Attrs().Name, err)
	}
	for _, a := range addrs {
		if a.IPNet.String() != want.IPNet.String() {
			if err := netlink.AddrDel(l, &a); err != nil {
				return fmt.Errorf("remove stale %s from %s: %w", a.IPNet, l.Attrs().Name, err)
			}
		}
	}
	if err := netlink.AddrReplace(l, want); err != nil {
		return fmt.Errorf("address %s on %s: %w", p, l.Attrs().Name, err)
	}
	return nil
}

func ensureUpMTU(l netlink.Link, mtu int) error {
	if l.Attrs().MTU != mtu {
		if err := netlink.LinkSetMTU(l, mtu); err != nil {
			return fmt.Errorf("MTU %d on %s: %w", mtu, l.Attrs().Name, err)
		}
	}
	if l.Attrs().Flags&net.FlagUp == 0 {
		if err := netlink.LinkSetUp(l); err != nil {
			return fmt.Errorf("set %s up: %w", l.Attrs().Name, err)
		}
	}
	return nil
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// SyncHosts makes the forwarding state towards remote hosts match hosts: an
// onlink route to each remote subnet via its VTEP address, a permanent
// neighbour entry for that address and an FDB entry sending its VTEP MAC to
// the remote underlay address. Entries for hosts no longer listed are removed.
func (o *Overlay) SyncHosts(hosts []cluster.Host) error {
	vx, err := netlink.LinkByName(VXLANName)
	if err != nil {
		return fmt.Errorf("%s: %w", VXLANName, err)
	}
	idx := vx.Attrs().Index
	routes := map[string]bool{}
	neighs := map[string]bool{}
	fdb := map[string]bool{}
	var errs []error
	for _, h := range hosts {
		if h.Name == o.cfg.Host.Name || !h.Subnet.IsValid() || !h.UnderlayIP.IsValid() {
			continue
		}
		mac, err := net.ParseMAC(h.VTEPMAC)
		if err != nil {
			errs = append(errs, fmt.Errorf("host %s: VTEP MAC %q: %w", h.Name, h.VTEPMAC, err))
			continue
		}
		vtep := cluster.VTEPAddr(h.Subnet)
		routes[h.Subnet.String()] = true
		neighs[vtep.String()] = true
		fdb[mac.String()] = true
		if err := netlink.NeighSet(&netlink.Neigh{LinkIndex: idx, Family: netlink.FAMILY_V4,
			State: netlink.NUD_PERMANENT, IP: vtep.AsSlice(), HardwareAddr: mac}); err != nil {
			errs = append(errs, fmt.Errorf("neighbour %s for host %s: %w", vtep, h.Name, err))
		}
		if err := netlink.NeighSet(&netlink.Neigh{LinkIndex: idx, Family: unix.AF_BRIDGE,
			Flags: netlink.NTF_SELF, State: netlink.NUD_PERMANENT, IP: h.UnderlayIP.AsSlice(), HardwareAddr: mac}); err != nil {
			errs = append(errs, fmt.Errorf("FDB entry %s for host %s: %w", mac, h.Name, err))
		}
		route := &netlink.Route{LinkIndex: idx, Dst: prefixNet(h.Subnet), Gw: vtep.AsSlice(), Flags: int(netlink.FLAG_ONLINK)}
		if o.cfg.FullMTU {
			route.MTU, route.MTULock = o.mtu, true
		}
		if err := netlink.RouteReplace(route); err != nil {
			errs = append(errs, fmt.Errorf("route to %s (host %s): %w", h.Subnet, h.Name, err))
		}
	}
	errs = append(errs, o.pruneRemote(vx, routes, neighs, fdb))
	return errors.Join(errs...)
}

func (o *Overlay) pruneRemote(vx netlink.Link, routes, neighs, fdb map[string]bool) error {
	var errs []error
	rs, err := netlinksafe.Dump(func() ([]netlink.Route, error) { return netlink.RouteList(vx, netlink.FAMILY_V4) })
	if err != nil {
		return fmt.Errorf("list routes on %s: %w", VXLANName, err)
	}
	for _, r := range rs {
		if r.Dst != nil && !routes[r.Dst.String()] && r.Table == 254 {
			o.log.Info("removing route to departed host", "dst", r.Dst)
			if err := netlink.RouteDel(&r); err != nil {
				errs = append(errs, fmt.Errorf("remove route %s: %w", r.Dst, err))
			}
		}
	}
	ns, err := netlinksafe.Dump(func() ([]netlink.Neigh, error) { return netlink.NeighList(vx.Attrs().Index, netlink.FAMILY_V4) })
	if err != nil {
		return fmt.Errorf("list neighbours on %s: %w", VXLANName, err)
	}
	for _, n := range ns {
		if n.State&netlink.NUD_PERMANENT != 0 && !neighs[n.IP.String()] {
			if err := netlink.NeighDel(&n); err != nil {
				errs = append(errs, fmt.Errorf("remove neighbour %s: %w", n.IP, err))
			}
		}
	}
	fs, err := netlinksafe.Dump(func() ([]netlink.Neigh, error) { return netlink.NeighList(vx.Attrs().Index, unix.AF_BRIDGE) })
	if err != nil {
		return fmt.Errorf("list FDB of %s: %w", VXLANName, err)
	}
	for _, n := range fs {
		if n.IP != nil && !fdb[n.HardwareAddr.String()] {
			n.Flags |= netlink.NTF_SELF
			if err := netlink.NeighDel(&n); err != nil {
				errs = append(errs, fmt.Errorf("remove FDB entry %s: %w", n.HardwareAddr, err))
			}
		}
	}
	return errors.Join(errs...)
}

// DefaultUnderlay returns the interface of the default IPv4 route.
func DefaultUnderlay() (string, error) {
	routes, err := netlinksafe.Dump(func() ([]netlink.Route, error) { return netlink.RouteList(nil, netlink.FAMILY_V4) })
	if err != nil {
		return "", fmt.Errorf("list routes: %w", err)
	}
	for _, r := range routes {
		if (r.Dst == nil || r.Dst.IP.IsUnspecified()) && r.LinkIndex > 0 {
			l, err := netlink.LinkByIndex(r.LinkIndex)
			if err != nil {
				return "", fmt.Errorf("default route interface: %w", err)
			}
			return l.Attrs().Name, nil
		}
	}
	return "", errors.New("no default route: name the underlay interface with --underlay-interface")
}
