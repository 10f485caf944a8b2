package policymap

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/tc/tctest"
)

// TestVerdictMatchesIptables: one rule set, two evaluators. The overlay's
// chain (SKIFF-POLICY as overlay.PolicyRules renders it, behind
// SKIFF-FORWARD's structure and SKIFF-DENY's REJECT) judges real packets
// forwarded by a router namespace; policymap.h judges the same packets
// (BPF_PROG_RUN, from the sending and the receiving container's end). For
// random rule sets and the whole flow matrix the verdicts must be the same:
// a packet arrives past the router exactly when the eBPF verdict allows it.
//
// Namespaces made here: src (sends each flow's first packet with a raw
// socket, any source address), router (forwards, runs the chain), dst
// (captures what arrives; no address of the matrix is its own).
func TestVerdictMatchesIptables(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces, iptables)")
	}
	if _, err := exec.LookPath("iptables-restore"); err != nil {
		t.Skip("needs iptables-restore")
	}
	n := newRouterNets(t)

	var objs skpTestObjects
	if err := loadSkpTestObjects(&objs, nil); err != nil {
		t.Fatal(err)
	}
	defer objs.Close()
	m := &Maps{Egress: objs.SkpEgress, Ingress: objs.SkpIngress, Verdicts: objs.SkpVerdicts}
	var local []netip.Addr // every container of the matrix, so both ends are judged
	flows(func(a, _ netip.Addr, _ uint8, _ uint16) bool {
		if a.As4()[0] == 10 && (len(local) == 0 || local[len(local)-1] != a) {
			local = append(local, a)
		}
		return true
	})

	mac := net.HardwareAddr{2, 0, 0, 0, 0, 1}
	rng := rand.New(rand.NewPCG(5, 6))
	for round := range 8 {
		set := randomSet(t, rng, 5+rng.IntN(25))
		if err := m.Sync(set, local); err != nil {
			t.Fatal(err)
		}
		n.loadChain(t, set)
		type probe struct {
			src, dst netip.Addr
			proto    uint8
			port     uint16
			allowed  bool
		}
		var probes []probe
		mismatch := 0
		flows(func(a, b netip.Addr, proto uint8, port uint16) bool {
			if a == b {
				return true // not forwarded
			}
			pkt := tctest.Eth(mac, mac, 0x0800, flowPacket(a, b, proto, port, uint16(round), 0))
			var verdicts []uint32
			if a.As4()[0] == 10 {
				v, _ := tctest.Run(t, objs.SkpTestEgress, pkt)
				verdicts = append(verdicts, v)
			}
			if b.As4()[0] == 10 {
				v, _ := tctest.Run(t, objs.SkpTestIngress, pkt)
				verdicts = append(verdicts, v)
			}
			for _, v := range verdicts[1:] {
				if v != verdicts[0] {
					t.Errorf("round %d, %s→%s %d/%d: the two ends judge %d and %d", round, a, b, proto, port, verdicts[0], v)
				}
			}
			if verdicts[0] != Allow && verdicts[0] != Deny {
				t.Fatalf("round %d, %s→%s %d/%d: verdict %d", round, a, b, proto, port, verdicts[0])
			}
			probes = append(probes, probe{a, b, proto, port, verdicts[0] == Allow})
			return true
		})
		// Every probe once; one allowed but not seen is sent again (up to
		// three times: a packet lost under the burst is no verdict). One
		// seen that the eBPF verdict denies is a mismatch at once.
		packet := func(id int) []byte {
			p := probes[id]
			return flowPacket(p.src, p.dst, p.proto, p.port, uint16(round), uint16(id+1))
		}
		arrived := n.send(t, len(probes), packet, nil)
		resent := 0
		for try := 0; try < 3; try++ {
			var missing []int
			for id, p := range probes {
				if p.allowed && !arrived[id] {
					missing = append(missing, id)
				}
			}
			if len(missing) == 0 {
				break
			}
			resent += len(missing)
			again := n.send(t, len(probes), packet, missing)
			for _, id := range missing {
				arrived[id] = again[id]
			}
		}
		for id, p := range probes {
			if arrived[id] != p.allowed {
				mismatch++
				if mismatch <= 5 {
					t.Errorf("round %d, %s→%s %d/%d: eBPF allows %v, the chain let it through %v\nrules:\n%s",
						round, p.src, p.dst, p.proto, p.port, p.allowed, arrived[id], strings.Join(overlay.PolicyRules(set), "\n"))
				}
			}
		}
		allowed := 0
		for _, p := range probes {
			if p.allowed {
				allowed++
			}
		}
		t.Logf("round %d: %d rules, %d flows (%d allowed), %d re-sent, %d mismatches", round, len(set), len(probes), allowed, resent, mismatch)
		if allowed == 0 || allowed == len(probes) {
			t.Errorf("round %d: every flow judged alike (%d of %d allowed): the matrix shows nothing", round, allowed, len(probes))
		}
	}
}

// flowPacket is the first packet of a flow as an IPv4 datagram: a TCP SYN,
// a UDP datagram, an ICMP echo request or a GRE packet; the round picks
// the source port, id the IP ID (how the capture tells probes apart).
func flowPacket(src, dst netip.Addr, proto uint8, port, round, id uint16) []byte {
	var l4 []byte
	switch proto {
	case 6:
		l4 = tctest.TCP(40000+round, port, 0x02, nil)
	case 17:
		l4 = tctest.UDP(40000+round, port, []byte("x"))
	case 1:
		l4 = tctest.ICMP(8, []byte("ping"))
	default:
		l4 = []byte("gre payload.")
	}
	return tctest.IPv4(tctest.IPOpts{ID: id, TTL: 64}, proto, src, dst, l4)
}

// routerNets are the test's three namespaces.
type routerNets struct {
	names   [3]string // src, router, dst
	send4   int       // raw socket in src
	capture int       // AF_PACKET socket on dst's interface
}

func newRouterNets(t *testing.T) *routerNets {
	t.Helper()
	id := fmt.Sprintf("%d", os.Getpid()%100000)
	n := &routerNets{names: [3]string{"skpsrc" + id, "skprtr" + id, "skpdst" + id}, send4: -1, capture: -1}
	t.Cleanup(func() {
		unix.Close(n.send4)
		unix.Close(n.capture)
		for _, ns := range n.names {
			exec.Command("ip", "netns", "del", ns).Run()
		}
	})
	src, rtr, dst := n.names[0], n.names[1], n.names[2]
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	for _, ns := range n.names {
		run("ip", "netns", "add", ns)
		run("ip", "-n", ns, "link", "set", "lo", "up")
	}
	run("ip", "-n", src, "link", "add", "eth0", "type", "veth", "peer", "name", "in", "netns", rtr)
	run("ip", "-n", dst, "link", "add", "eth0", "type", "veth", "peer", "name", "out", "netns", rtr)
	run("ip", "-n", src, "addr", "add", "169.254.1.2/24", "dev", "eth0")
	run("ip", "-n", rtr, "addr", "add", "169.254.1.1/24", "dev", "in")
	run("ip", "-n", rtr, "addr", "add", "169.254.2.1/24", "dev", "out")
	run("ip", "-n", dst, "addr", "add", "169.254.2.2/24", "dev", "eth0")
	for _, l := range [][2]string{{src, "eth0"}, {rtr, "in"}, {rtr, "out"}, {dst, "eth0"}} {
		run("ip", "-n", l[0], "link", "set", l[1], "up")
	}
	run("ip", "-n", src, "route", "add", "default", "via", "169.254.1.1")
	run("ip", "-n", rtr, "route", "add", "10.0.0.0/8", "via", "169.254.2.2")
	run("ip", "-n", rtr, "route", "add", "192.0.2.0/24", "via", "169.254.2.2")
	// The matrix's sources are no addresses of src's: the router must not
	// check them against its routes.
	for _, k := range []string{"net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.in.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"} {
		run("ip", "netns", "exec", rtr, "sysctl", "-qw", k)
	}
	inNetns(t, src, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		n.send4 = fd
		return err
	})
	inNetns(t, dst, func() error {
		ifc, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK, int(htons(unix.ETH_P_IP)))
		if err != nil {
			return err
		}
		n.capture = fd
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 32<<20); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_IP), Ifindex: ifc.Index})
	})
	return n
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// inNetns runs f on a thread in namespace name (sockets it opens stay
// there).
func inNetns(t *testing.T, name string, f func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		ns, err := netns.GetFromName(name)
		if err != nil {
			done <- err
			return
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			done <- err
			return
		}
		done <- f()
	}()
	if err := <-done; err != nil {
		t.Fatalf("in %s: %v", name, err)
	}
}

// loadChain puts set into the router's FORWARD as the overlay's chains
// judge a new flow.
func (n *routerNets) loadChain(t *testing.T, set policy.Set) {
	t.Helper()
	rules := strings.Join([]string{"*filter", ":FORWARD ACCEPT [0:0]", ":SKIFF-FORWARD - [0:0]", ":SKIFF-POLICY - [0:0]", ":SKIFF-DENY - [0:0]",
		"-A FORWARD -j SKIFF-FORWARD",
		"-A SKIFF-FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
		"-A SKIFF-FORWARD -j SKIFF-POLICY",
		"-A SKIFF-FORWARD -j ACCEPT",
		"-A SKIFF-DENY -j REJECT --reject-with icmp-admin-prohibited"}, "\n") + "\n"
	for _, r := range overlay.PolicyRules(set) {
		rules += r + "\n"
	}
	// Every probe is a flow's first packet: conntrack would take a probe
	// for the reply of an earlier one where the protocol has no ports (GRE
	// b→a after a→b), and accept it as established whatever the rules.
	rules += "COMMIT\n*raw\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j CT --notrack\n"
	cmd := exec.Command("ip", "netns", "exec", n.names[1], "iptables-restore")
	cmd.Stdin = strings.NewReader(rules + "COMMIT\n")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("iptables-restore: %v: %s\n%s", err, out, rules)
	}
}

// send sends the probes ids (nil: all count of them) from src, paced, and
// reports which arrived at dst, by IP ID.
func (n *routerNets) send(t *testing.T, count int, packet func(id int) []byte, ids []int) []bool {
	t.Helper()
	n.drain(nil, nil)
	if ids == nil {
		for id := range count {
			ids = append(ids, id)
		}
	}
	arrived := make([]bool, count)
	for i, id := range ids {
		pkt := packet(id)
		dst := [4]byte(pkt[16:20])
		if err := unix.Sendto(n.send4, pkt, 0, &unix.SockaddrInet4{Addr: dst}); err != nil {
			t.Fatalf("send probe %d: %v", id, err)
		}
		if i%64 == 63 {
			n.drain(arrived, packet)
		}
	}
	deadline := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(deadline) {
		n.drain(arrived, packet)
		time.Sleep(10 * time.Millisecond)
	}
	return arrived
}

// drain reads what arrived at dst, marking probes by their IP ID (id+1):
// a packet counts when its addresses and protocol are its probe's (the
// router's rejections go to the probes' sources, which it routes to dst).
func (n *routerNets) drain(arrived []bool, packet func(id int) []byte) {
	buf := make([]byte, 2048)
	for {
		k, _, err := unix.Recvfrom(n.capture, buf, 0)
		if err != nil {
			return // EAGAIN: nothing more now
		}
		if k < 20 || arrived == nil {
			continue
		}
		id := int(binary.BigEndian.Uint16(buf[4:6])) - 1
		if id < 0 || id >= len(arrived) {
			continue
		}
		if p := packet(id); buf[9] == p[9] && string(buf[12:20]) == string(p[12:20]) {
			arrived[id] = true
		}
	}
}
