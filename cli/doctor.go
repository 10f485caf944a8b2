package cli

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cgroup"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/flagfile"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/store"
)

// A finding of skiff doctor: what was checked, how it went, and the fix.
type finding struct {
	Check  string `json:"check"`
	Result string `json:"result"` // ok, warn (skiff runs, with less), fail (skiffd will not run as asked)
	Detail string `json:"detail"`
	Fix    string `json:"fix,omitempty"`
}

const (
	resultOK   = "ok"
	resultWarn = "warn"
	resultFail = "fail"
)

// minKernel is the oldest kernel skiff supports (README "Requirements").
var minKernel = [2]int{6, 6}

// cmdDoctor says what this host has and lacks for skiff and each of its
// layers, with the fix; exit status 1 when something skiffd needs is
// missing. It changes nothing on the host.
func cmdDoctor(ctx context.Context, env Env, args []string) error {
	fs := flags(env, "doctor")
	underlay := fs.String("underlay-interface", "", "the underlay interface (default: that of the default route)")
	endpoints := fs.String("etcd-endpoints", "", "also check the cluster store at these URLs (and, through it, the other hosts)")
	var creds store.TLS
	fs.StringVar(&creds.CAFile, "etcd-cafile", "", "CA of the store's certificate")
	fs.StringVar(&creds.CertFile, "etcd-certfile", "", "this host's client certificate")
	fs.StringVar(&creds.KeyFile, "etcd-keyfile", "", "key of the client certificate")
	fs.BoolVar(&creds.Insecure, "etcd-insecure", false, "reach the store over plain HTTP")
	jsonOut := fs.Bool("json", false, "print the findings as JSON")
	config := fs.String("config", "", "take the flags above from skiffd's config file (e.g. /etc/skiff/skiffd.conf; its other keys are skipped); the command line overrides it")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *config != "" {
		if err := flagfile.ApplyKnown(fs, *config); err != nil {
			return err
		}
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	found := []finding{checkKernel(), checkBTF(), checkRoot(), checkCgroup2(), checkConntrack(), checkIptables(), checkBrNetfilter()}
	found = append(found, checkUnderlay(*underlay)...)
	if os.Geteuid() == 0 {
		for _, r := range layer.Registered() {
			f := finding{Check: "layer " + r.Name, Result: resultOK, Detail: "this host can run it"}
			if r.Probe != nil {
				if err := r.Probe(nil); err != nil {
					f.Result, f.Detail, f.Fix = resultWarn, err.Error(), "auto runs without it; docs/layers.md lists what each layer needs"
				}
			}
			found = append(found, f)
		}
	}
	if *endpoints != "" {
		found = append(found, checkStore(ctx, layer.SplitList(*endpoints), creds)...)
	}
	failed := 0
	for _, f := range found {
		if f.Result == resultFail {
			failed++
		}
	}
	if *jsonOut {
		enc := json.NewEncoder(env.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(found); err != nil {
			return err
		}
	} else {
		tw := tabwriter.NewWriter(env.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "CHECK\tRESULT\tDETAIL\tFIX")
		for _, f := range found {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", f.Check, f.Result, f.Detail, f.Fix)
		}
		tw.Flush()
	}
	if failed > 0 {
		fmt.Fprintf(env.Stderr, "skiff doctor: %d checks failed\n", failed)
		return exitError(1)
	}
	return nil
}

func checkKernel() finding {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return finding{Check: "kernel", Result: resultFail, Detail: err.Error()}
	}
	rel := unix.ByteSliceToString(u.Release[:])
	f := finding{Check: "kernel", Result: resultOK, Detail: "Linux " + rel}
	var major, minor int
	if _, err := fmt.Sscanf(rel, "%d.%d", &major, &minor); err != nil {
		f.Result, f.Detail = resultWarn, "unreadable release "+rel
	} else if major < minKernel[0] || major == minKernel[0] && minor < minKernel[1] {
		f.Result = resultFail
		f.Fix = fmt.Sprintf("Linux %d.%d or later (Debian 12: the bookworm-backports kernel)", minKernel[0], minKernel[1])
	}
	return f
}

func checkBTF() finding {
	if _, err := os.Stat("/sys/kernel/btf/vmlinux"); err != nil {
		return finding{Check: "kernel BTF", Result: resultWarn, Detail: "no /sys/kernel/btf/vmlinux",
			Fix: "a kernel built with CONFIG_DEBUG_INFO_BTF=y (the layers that need kernel types stay off)"}
	}
	return finding{Check: "kernel BTF", Result: resultOK, Detail: "/sys/kernel/btf/vmlinux"}
}

func checkRoot() finding {
	if os.Geteuid() != 0 {
		return finding{Check: "root", Result: resultWarn, Detail: "not root: the layers' probes are skipped", Fix: "run skiff doctor as root"}
	}
	return finding{Check: "root", Result: resultOK, Detail: "the layers' probes ran"}
}

func checkCgroup2() finding {
	if cgroup.Mounted() {
		return finding{Check: "cgroup v2", Result: resultOK, Detail: "mounted"}
	}
	if raw, err := os.ReadFile("/proc/filesystems"); err == nil && strings.Contains(string(raw), "cgroup2") {
		return finding{Check: "cgroup v2", Result: resultOK, Detail: "not mounted; skiffd mounts it at " + cgroup.DefaultRoot}
	}
	return finding{Check: "cgroup v2", Result: resultWarn, Detail: "the kernel has no cgroup2 file system",
		Fix: "the sockets and channels layers stay off without it"}
}

func checkConntrack() finding {
	if _, err := os.Stat("/proc/sys/net/netfilter/nf_conntrack_max"); err != nil {
		return finding{Check: "conntrack", Result: resultFail, Detail: "no netfilter connection tracking",
			Fix: "modprobe nf_conntrack (the overlay's policy chain needs it)"}
	}
	return finding{Check: "conntrack", Result: resultOK, Detail: "nf_conntrack"}
}

func checkIptables() finding {
	out, err := exec.Command("iptables", "-V").CombinedOutput()
	if err != nil {
		return finding{Check: "iptables", Result: resultFail, Detail: "iptables does not run: " + strings.TrimSpace(string(out)),
			Fix: "apt install iptables"}
	}
	return finding{Check: "iptables", Result: resultOK, Detail: strings.TrimSpace(string(out))}
}

// checkBrNetfilter: same-host policy between containers of one bridge
// needs bridged packets to pass iptables.
func checkBrNetfilter() finding {
	const path = "/proc/sys/net/bridge/bridge-nf-call-iptables"
	raw, err := os.ReadFile(path)
	if err != nil {
		f := finding{Check: "br_netfilter", Result: resultFail, Detail: "br_netfilter is not loaded",
			Fix: "modprobe br_netfilter, and br_netfilter in /etc/modules-load.d (policy between containers of one host needs it)"}
		if kernelConfig("CONFIG_BRIDGE_NETFILTER") == "" {
			f.Detail = "the kernel has no br_netfilter"
		}
		return f
	}
	if v := strings.TrimSpace(string(raw)); v != "1" {
		return finding{Check: "br_netfilter", Result: resultWarn, Detail: "bridge-nf-call-iptables = " + v, Fix: "skiffd sets it to 1"}
	}
	return finding{Check: "br_netfilter", Result: resultOK, Detail: "bridge-nf-call-iptables = 1"}
}

// checkUnderlay: the underlay device, its MTU and the overlay's.
func checkUnderlay(name string) []finding {
	var err error
	if name == "" {
		if name, err = overlay.DefaultUnderlay(); err != nil {
			return []finding{{Check: "underlay", Result: resultFail, Detail: err.Error(), Fix: "give skiffd --underlay-interface"}}
		}
	}
	lk, err := netlink.LinkByName(name)
	if err != nil {
		return []finding{{Check: "underlay", Result: resultFail, Detail: fmt.Sprintf("%s: %v", name, err), Fix: "give skiffd --underlay-interface"}}
	}
	addr, err := overlay.UnderlayAddr(name)
	if err != nil {
		return []finding{{Check: "underlay", Result: resultFail, Detail: err.Error(), Fix: "an IPv4 address on the underlay interface"}}
	}
	mtu := lk.Attrs().MTU
	f := finding{Check: "underlay MTU", Result: resultOK, Detail: fmt.Sprintf("%s %d: containers get %d (%d with --cache-tunnel rewrite)", name, mtu, mtu-50, mtu)}
	if mtu-50 < 1280 {
		f.Result, f.Fix = resultWarn, "an underlay MTU of 1330 or more (VXLAN takes 50 bytes)"
	}
	return []finding{{Check: "underlay", Result: resultOK, Detail: fmt.Sprintf("%s %s", name, addr)}, f}
}

// checkStore reaches the store and, through the hosts it lists, says
// whether each other host's underlay address has a route and, when skiffd
// runs here, whether the overlay reaches the host (checkOverlay).
func checkStore(ctx context.Context, endpoints []string, creds store.TLS) []finding {
	s, err := store.Open(endpoints, creds)
	if err != nil {
		return []finding{{Check: "store", Result: resultFail, Detail: err.Error(), Fix: "the store's URL and this host's certificate (docs/install.md)"}}
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	hosts, err := s.Hosts(ctx)
	if err != nil {
		return []finding{{Check: "store", Result: resultFail, Detail: err.Error(), Fix: "TCP 2379 open to the store's hosts; the certificate of this host (skiff cert issue)"}}
	}
	out := []finding{{Check: "store", Result: resultOK, Detail: fmt.Sprintf("%s: %d hosts", strings.Join(endpoints, ","), len(hosts))}}
	_, vxErr := netlink.LinkByName(overlay.VXLANName)
	own, _ := netlink.AddrList(nil, netlink.FAMILY_ALL)
	for _, h := range hosts {
		if slices.ContainsFunc(own, func(x netlink.Addr) bool { return x.IP.Equal(h.UnderlayIP.AsSlice()) }) {
			continue // this host
		}
		f := finding{Check: "route to " + h.Name, Result: resultOK}
		routes, err := netlink.RouteGet(h.UnderlayIP.AsSlice())
		if err != nil || len(routes) == 0 {
			f.Result, f.Detail, f.Fix = resultFail, fmt.Sprintf("no route to %s: %v", h.UnderlayIP, err), "a route to the host's underlay address"
		} else {
			dev := strconv.Itoa(routes[0].LinkIndex)
			if lk, err := netlink.LinkByIndex(routes[0].LinkIndex); err == nil {
				dev = lk.Attrs().Name
			}
			f.Detail = fmt.Sprintf("%s via %s", h.UnderlayIP, dev)
		}
		out = append(out, f)
		if f.Result == resultOK {
			out = append(out, checkOverlay(h, vxErr))
		}
	}
	return out
}

// checkOverlay pings host h's gateway (the first address of its subnet,
// on its bridge) from this host through the overlay: the echo and its
// reply cross the underlay as VXLAN (UDP 4789) both ways, so a reply says
// that the port is open and both agents set up their side. It needs skiffd
// running here (vxErr: no VXLAN device).
func checkOverlay(h cluster.Host, vxErr error) finding {
	f := finding{Check: "overlay to " + h.Name, Result: resultOK}
	gw := cluster.Gateway(h.Subnet)
	if os.Geteuid() != 0 {
		f.Result, f.Detail, f.Fix = resultWarn, "not probed: an ICMP echo needs root", "run skiff doctor as root"
		return f
	}
	if vxErr != nil {
		f.Result, f.Detail, f.Fix = resultWarn, "not probed: skiffd does not run here ("+overlay.VXLANName+": "+vxErr.Error()+")",
			"start skiffd, then run skiff doctor again"
		return f
	}
	took, err := echo(gw, 2*time.Second)
	if err != nil {
		f.Result, f.Detail = resultFail, fmt.Sprintf("no echo from %s (%s's gateway): %v", gw, h.Name, err)
		f.Fix = fmt.Sprintf("UDP 4789 open both ways between this host and %s, and ICMP echo to %s allowed there; skiffd running on %s (skiff status there)", h.UnderlayIP, gw, h.Name)
		return f
	}
	f.Detail = fmt.Sprintf("echo from %s (%s's gateway) in %v over VXLAN (UDP 4789)", gw, h.Name, took.Round(10*time.Microsecond))
	return f
}

// echo sends one ICMP echo request to dst and waits for its reply.
func echo(dst netip.Addr, timeout time.Duration) (time.Duration, error) {
	c, err := icmp.ListenPacket("ip4:icmp", "0.0.0.0")
	if err != nil {
		return 0, err
	}
	defer c.Close()
	id := os.Getpid() & 0xffff
	req, err := (&icmp.Message{Type: ipv4.ICMPTypeEcho, Body: &icmp.Echo{ID: id, Seq: 1, Data: []byte("skiff doctor")}}).Marshal(nil)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if err := c.SetDeadline(start.Add(timeout)); err != nil {
		return 0, err
	}
	if _, err := c.WriteTo(req, &net.IPAddr{IP: dst.AsSlice()}); err != nil {
		return 0, err
	}
	buf := make([]byte, 1500)
	for {
		n, from, err := c.ReadFrom(buf)
		if err != nil {
			return 0, err
		}
		m, err := icmp.ParseMessage(1, buf[:n]) // 1: ICMP for IPv4
		if err != nil || m.Type != ipv4.ICMPTypeEchoReply || from.String() != dst.String() {
			continue
		}
		if e, ok := m.Body.(*icmp.Echo); ok && e.ID == id && e.Seq == 1 {
			return time.Since(start), nil
		}
	}
}

// kernelConfig returns the value of a kernel build option from
// /proc/config.gz ("y", "m"), or "" when it is unset or unknown.
func kernelConfig(option string) string {
	f, err := os.Open("/proc/config.gz")
	if err != nil {
		return ""
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		return ""
	}
	sc := bufio.NewScanner(z)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), option+"="); ok {
			return v
		}
	}
	return ""
}
