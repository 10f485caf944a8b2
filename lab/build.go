package lab

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/skiffnet/skiff/bpffs"
	"github.com/skiffnet/skiff/store"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

func addNetns(name string) error { return run("ip", "netns", "add", name) }

// handleAt returns a netlink handle working inside a named namespace, so no
// OS thread of ours has to change namespace.
func handleAt(name string) (*netlink.Handle, netns.NsHandle, error) {
	ns, err := netns.GetFromName(name)
	if err != nil {
		return nil, 0, fmt.Errorf("open netns %s: %w", name, err)
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		ns.Close()
		return nil, 0, fmt.Errorf("netlink in %s: %w", name, err)
	}
	return h, ns, nil
}

func linkUp(h *netlink.Handle, name string, addr netip.Prefix, mtu int) error {
	l, err := h.LinkByName(name)
	if err != nil {
		return fmt.Errorf("link %s: %w", name, err)
	}
	if mtu > 0 {
		if err := h.LinkSetMTU(l, mtu); err != nil {
			return fmt.Errorf("MTU of %s: %w", name, err)
		}
	}
	if addr.IsValid() {
		ipnet := &net.IPNet{IP: addr.Addr().AsSlice(), Mask: net.CIDRMask(addr.Bits(), 32)}
		if err := h.AddrReplace(l, &netlink.Addr{IPNet: ipnet}); err != nil {
			return fmt.Errorf("address %s on %s: %w", addr, name, err)
		}
	}
	if err := h.LinkSetUp(l); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}

// switchMAC is the underlay bridge's address. Without one of its own a
// bridge takes the lowest of its ports' addresses, and a host that leaves
// with that port changes it: every host's ARP entry for etcd then points at
// an address nobody has, and the cluster store is unreachable until the
// entry goes stale (a flaky TestHostJoinAndLeave).
var switchMAC = net.HardwareAddr{0x02, 0x5c, 0x1f, 0xf0, 0, 1}

// buildSwitch creates the underlay switch: a namespace with a bridge that
// every host's eth0 plugs into. The bridge carries the switch's own address
// and those of the other etcd members: each member listens on its own.
func (l *Lab) buildSwitch() error {
	name := l.switchNetns()
	if err := addNetns(name); err != nil {
		return err
	}
	h, ns, err := handleAt(name)
	if err != nil {
		return err
	}
	defer ns.Close()
	defer h.Close()
	if err := h.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0", MTU: l.Config.UnderlayMTU, HardwareAddr: switchMAC}}); err != nil {
		return fmt.Errorf("underlay bridge: %w", err)
	}
	if err := linkUp(h, "lo", netip.Prefix{}, 0); err != nil {
		return err
	}
	if err := linkUp(h, "br0", netip.PrefixFrom(switchAddr, underlayNet.Bits()), l.Config.UnderlayMTU); err != nil {
		return err
	}
	for _, m := range l.Etcd[1:] {
		if err := linkUp(h, "br0", netip.PrefixFrom(m.IP, underlayNet.Bits()), 0); err != nil {
			return err
		}
	}
	return nil
}

// buildHost creates a host namespace with eth0 plugged into the switch.
func (l *Lab) buildHost(host Host) error {
	if err := addNetns(host.Netns); err != nil {
		return err
	}
	sw, swns, err := handleAt(l.switchNetns())
	if err != nil {
		return err
	}
	defer swns.Close()
	defer sw.Close()
	hh, hns, err := handleAt(host.Netns)
	if err != nil {
		return err
	}
	defer hns.Close()
	defer hh.Close()
	br, err := sw.LinkByName("br0")
	if err != nil {
		return fmt.Errorf("underlay bridge: %w", err)
	}
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: host.Name, MTU: l.Config.UnderlayMTU, MasterIndex: br.Attrs().Index},
		PeerName:      "eth0",
		PeerNamespace: netlink.NsFd(int(hns)),
	}
	if err := sw.LinkAdd(veth); err != nil {
		return fmt.Errorf("underlay cable for %s: %w", host.Name, err)
	}
	if err := linkUp(sw, host.Name, netip.Prefix{}, 0); err != nil {
		return err
	}
	if err := linkUp(hh, "lo", netip.Prefix{}, 0); err != nil {
		return err
	}
	if err := linkUp(hh, "eth0", netip.PrefixFrom(host.UnderlayIP, underlayNet.Bits()), l.Config.UnderlayMTU); err != nil {
		return err
	}
	return tuneNetns(host.Netns)
}

// tuneNetns gives every lab namespace, host or container, the same TCP
// settings, so benchmarks compare data paths and not sysctls: many short
// connections (tcp_crr, the connect benchmark) would otherwise spend their
// time searching for an ephemeral port among TIME_WAIT sockets.
func tuneNetns(ns string) error {
	return run("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
		"net.ipv4.tcp_tw_reuse=1", "net.ipv4.ip_local_port_range=10000 65000")
}

// bpfDir is where a host's agent pins its eBPF maps.
func (l *Lab) bpfDir(host string) string {
	return filepath.Join(bpffs.Root, "skiff", "lab-"+l.Config.Name, host)
}

// AgentLog is the file host's agent logs to.
func (l *Lab) AgentLog(host string) string { return filepath.Join(l.hostDir(host), "skiffd.log") }

// hostDir is where a host keeps its socket, state and log.
func (l *Lab) hostDir(host string) string { return filepath.Join(l.dir(), host) }

func (l *Lab) startAgent(h *Host) error {
	dir := l.hostDir(h.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	creds, err := l.etcdFlags(h.Name)
	if err != nil {
		return err
	}
	args := append([]string{"--name", h.Name, "--underlay-interface", "eth0", "--etcd-endpoints", l.etcdURL(),
		"--socket", h.Socket, "--state-dir", filepath.Join(dir, "state"), "--mode", l.Config.Mode,
		"--cluster-cidr", l.Config.ClusterCIDR, "--bpf-dir", l.bpfDir(h.Name)}, creds...)
	args = append(args, l.Config.AgentArgs...)
	if l.Config.Runs("sockets") {
		args = append(args, "--broker", filepath.Join(l.Config.BinDir, "skiff-broker"),
			"--seccomp-socket", l.SeccompSocket(h.Name))
	}
	pid, err := l.spawn(h.Netns, l.AgentLog(h.Name), filepath.Join(l.Config.BinDir, "skiffd"), args...)
	if err != nil {
		return fmt.Errorf("start agent on %s: %w", h.Name, err)
	}
	h.AgentPID = pid
	return nil
}

// etcdFlags are the skiffd flags that give host its own client certificate.
func (l *Lab) etcdFlags(host string) ([]string, error) {
	t, err := l.EtcdTLS(host)
	if err != nil {
		return nil, err
	}
	if t.Insecure {
		return []string{"--etcd-insecure"}, nil
	}
	return []string{"--etcd-cafile", t.CAFile, "--etcd-certfile", t.CertFile, "--etcd-keyfile", t.KeyFile}, nil
}

// startEtcd runs the store's members in the switch namespace. The lab
// makes the CA first, so it can issue the agents' certificates, and the
// server certificate every member serves (for all their addresses, which
// peers check too): members starting together would race to issue it.
func (l *Lab) startEtcd() error {
	if !l.Config.EtcdInsecure {
		if err := l.etcdPKI(); err != nil {
			return fmt.Errorf("lab CA: %w", err)
		}
	}
	for i := range l.Etcd {
		if err := l.startMember(&l.Etcd[i]); err != nil {
			return err
		}
	}
	return l.save()
}

func (l *Lab) etcdPKI() error {
	p, _, err := store.EnsurePKI(l.pkiDir())
	if err != nil {
		return err
	}
	hosts := []string{"127.0.0.1", "localhost"}
	for _, m := range l.Etcd {
		hosts = append(hosts, m.IP.String())
	}
	if _, _, _, err := p.EnsureServer(hosts); err != nil {
		return err
	}
	_, _, err = p.EnsureClient(store.AdminName)
	return err
}

// startMember starts one member of the store, in a cluster of them all.
func (l *Lab) startMember(m *Member) error {
	var initial []string
	for _, o := range l.Etcd {
		initial = append(initial, o.Name+"="+l.peerURL(o))
	}
	args := []string{"lab", "etcd-server", "--dir", filepath.Join(l.dir(), "etcd", m.Name), "--name", m.Name,
		"--listen", l.clientURL(*m), "--peer", l.peerURL(*m), "--initial-cluster", strings.Join(initial, ","), "--pki-dir", l.pkiDir()}
	if l.Config.EtcdInsecure {
		args = append(args, "--etcd-insecure")
	}
	pid, err := l.spawn(m.Netns, filepath.Join(l.dir(), "etcd-"+m.Name+".log"), filepath.Join(l.Config.BinDir, "skiff"), args...)
	if err != nil {
		return fmt.Errorf("start etcd member %s: %w", m.Name, err)
	}
	m.PID = pid
	return nil
}
