package lab

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/tc"
	"github.com/skiffnet/skiff/tc/tctest"
)

const spoofPort = 7700

// sendRawUDP sends a UDP datagram from src:sport to dst:dport through a raw
// socket of the calling thread's namespace (IP_HDRINCL: the kernel keeps
// any source it is given).
func sendRawUDP(src, dst netip.Addr, sport, dport uint16, payload []byte) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	pkt := tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, src, dst, tctest.UDP(sport, dport, payload))
	return unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: dst.As4()})
}

// sendFrame sends an Ethernet frame on the calling thread's namespace's
// eth0 (AF_PACKET).
func sendFrame(frame []byte) error {
	ifc, err := net.InterfaceByName("eth0")
	if err != nil {
		return err
	}
	proto := binary.BigEndian.Uint16(frame[12:])
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Sendto(fd, frame, 0, &unix.SockaddrLinklayer{Ifindex: ifc.Index, Protocol: htons(proto), Halen: 6})
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// arpRequest is an ARP request from Ethernet source eth claiming sha/spa,
// for tpa, broadcast.
func arpRequest(eth, sha net.HardwareAddr, spa, tpa netip.Addr) []byte {
	b := []byte{0, 1, 8, 0, 6, 4, 0, 1}
	s, t := spa.As4(), tpa.As4()
	b = append(append(append(append(b, sha...), s[:]...), make([]byte, 6)...), t[:]...)
	return tctest.Eth(net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, eth, 0x0806, b)
}

// macOf returns the MAC of target's eth0.
func macOf(t *testing.T, l *Lab, target string) net.HardwareAddr {
	t.Helper()
	var mac net.HardwareAddr
	if err := l.Do(target, func() error {
		ifc, err := net.InterfaceByName("eth0")
		if err == nil {
			mac = ifc.HardwareAddr
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return mac
}

// udpReceiver listens on spoofPort in target and returns what arrives
// within a second after each call of the returned function.
func udpReceiver(t *testing.T, l *Lab, target string) func() []string {
	t.Helper()
	var conn *net.UDPConn
	if err := l.Do(target, func() (err error) {
		conn, err = net.ListenUDP("udp4", &net.UDPAddr{Port: spoofPort})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return func() []string {
		var got []string
		buf := make([]byte, 256)
		conn.SetReadDeadline(time.Now().Add(time.Second))
		for {
			n, from, err := conn.ReadFromUDP(buf)
			if err != nil {
				return got
			}
			got = append(got, fmt.Sprintf("%q from %s", buf[:n], from))
		}
	}
}

// TestSourceCheck: in every layer, a container (root in its namespace:
// raw and packet sockets) cannot send with another source than its own —
// a neighbour's, another host's container's, an outside address — to a
// container on another host or on its own; cannot teach its host a forged
// ARP sender; and cannot move a neighbour's MAC to its own bridge port.
// What it sends from its own address still arrives. In cache mode the
// neighbour's flow is on the fast path first, so the forged datagram
// would take it. In overlay mode, the check is also taken away while the
// agent is down (forged datagrams then arrive: the test can tell) and put
// back by the agent's restart; DEL removes it.
func TestSourceCheck(t *testing.T) {
	for _, mode := range []string{"overlay", "cache", "sockets"} {
		t.Run(mode, func(t *testing.T) {
			l := newLab(t, Config{Name: "tspoof", Hosts: 2, ContainersPerHost: 2, Mode: mode})
			attacker, _ := l.Container("h1/c1")
			nbr, _ := l.Container("h1/c2")
			remote, _ := l.Container("h2/c1")
			other, _ := l.Container("h2/c2")
			recvNbr, recvRemote := udpReceiver(t, l, nbr.Name), udpReceiver(t, l, remote.Name)
			if mode == "cache" {
				warmFlow(t, l, nbr.Name, remote.Name, recvRemote)
			}
			subnet := hostSubnet(t, l, "h1")
			gw := cluster.Gateway(subnet)
			outside := netip.MustParseAddr("192.0.2.77")
			unassigned := gw
			for range 200 {
				unassigned = unassigned.Next()
			}
			forge := func() {
				t.Helper()
				for _, c := range []struct {
					src    netip.Addr
					sport  uint16
					victim *Container
				}{
					{nbr.IP, spoofPort + 1, remote}, // the neighbour's flow, cached in cache mode
					{other.IP, spoofPort, nbr},
					{outside, spoofPort, remote},
					{outside, spoofPort, nbr},
					{unassigned, spoofPort, remote},
				} {
					msg := []byte(fmt.Sprintf("forged %s to %s", c.src, c.victim.Name))
					if err := l.Do(attacker.Name, func() error {
						return sendRawUDP(c.src, c.victim.IP, c.sport, spoofPort, msg)
					}); err != nil {
						t.Fatal(err)
					}
				}
			}
			own := func() {
				t.Helper()
				for _, v := range []*Container{nbr, remote} {
					if err := l.Do(attacker.Name, func() error {
						return sendRawUDP(attacker.IP, v.IP, spoofPort, spoofPort, []byte("own"))
					}); err != nil {
						t.Fatal(err)
					}
				}
			}
			expectForged := func(want bool) {
				t.Helper()
				forge()
				for name, recv := range map[string]func() []string{nbr.Name: recvNbr, remote.Name: recvRemote} {
					got := recv()
					if !want && len(got) > 0 {
						t.Errorf("%s received forged datagrams: %v", name, got)
					}
					if want && len(got) == 0 {
						t.Errorf("%s received no forged datagram without the check", name)
					}
				}
				own()
				for name, recv := range map[string]func() []string{nbr.Name: recvNbr, remote.Name: recvRemote} {
					if got := recv(); len(got) != 1 {
						t.Errorf("%s received %v from the attacker's own address, want one datagram", name, got)
					}
				}
			}
			expectForged(false)

			// ARP: the attacker claims its neighbour's address to its host.
			attackerMAC, nbrMAC := macOf(t, l, attacker.Name), macOf(t, l, nbr.Name)
			if err := l.Do(attacker.Name, func() error {
				return sendFrame(arpRequest(attackerMAC, attackerMAC, nbr.IP, gw))
			}); err != nil {
				t.Fatal(err)
			}
			// A frame from the neighbour's MAC (own address otherwise).
			frame := tctest.Eth(overlay.BridgeMAC(l.Hosts[0].UnderlayIP), nbrMAC, 0x0800,
				tctest.IPv4(tctest.IPOpts{}, tctest.ProtoUDP, attacker.IP, gw, tctest.UDP(spoofPort, 9, []byte("mac"))))
			if err := l.Do(attacker.Name, func() error { return sendFrame(frame) }); err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond)
			attackerVeth := overlay.VethName(attacker.ID, "eth0")
			if err := l.Do("h1", func() error {
				br, err := netlink.LinkByName(overlay.BridgeName)
				if err != nil {
					return err
				}
				neighs, err := netlink.NeighList(br.Attrs().Index, netlink.FAMILY_V4)
				if err != nil {
					return err
				}
				for _, n := range neighs {
					if n.IP.Equal(nbr.IP.AsSlice()) && bytes.Equal(n.HardwareAddr, attackerMAC) {
						t.Errorf("the host's ARP entry for %s is the attacker's MAC %s", nbr.IP, attackerMAC)
					}
				}
				veth, err := netlink.LinkByName(attackerVeth)
				if err != nil {
					return err
				}
				fdb, err := netlink.NeighList(veth.Attrs().Index, unix.AF_BRIDGE)
				if err != nil {
					return err
				}
				for _, n := range fdb {
					if bytes.Equal(n.HardwareAddr, nbrMAC) {
						t.Errorf("the bridge learned the neighbour's MAC %s on the attacker's port", nbrMAC)
					}
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			st, err := agentOf(t, l, "h1").Status(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("source check drops on h1: %v", st.SourceDrops)
			for _, r := range []string{"ip_source", "arp_sender", "mac_source"} {
				if st.SourceDrops[r] == 0 {
					t.Errorf("no %s drop counted: %v", r, st.SourceDrops)
				}
			}
			if mode != "overlay" {
				return
			}
			// Lost while the agent is down, put back when it starts.
			ctx := context.Background()
			if err := l.StopAgent(ctx, "h1"); err != nil {
				t.Fatal(err)
			}
			if err := l.Do("h1", func() error {
				v, err := netlink.LinkByName(attackerVeth)
				if err != nil {
					return err
				}
				return tc.Detach(&netlink.Handle{}, v, tc.Ingress, "skiff-source")
			}); err != nil {
				t.Fatal(err)
			}
			waitSourcePrograms(t, l, attackerVeth, 0)
			expectForged(true)
			if err := l.StartAgent(ctx, "h1"); err != nil {
				t.Fatal(err)
			}
			waitSourcePrograms(t, l, attackerVeth, 1)
			expectForged(false)
			// DEL takes the filter with the veth, and the entry.
			entries := sourceEntries(t, l, "h1")
			if err := l.RemoveContainer(ctx, attacker.Name); err != nil {
				t.Fatal(err)
			}
			if n := sourceEntries(t, l, "h1"); n != entries-1 {
				t.Errorf("%d source check entries after DEL, want %d", n, entries-1)
			}
		})
	}
}

// warmFlow has from and to exchange datagrams (from's port spoofPort+1, to's
// spoofPort) until the cache carries them, read by recv on to's side.
func warmFlow(t *testing.T, l *Lab, from, to string, recv func() []string) {
	t.Helper()
	dst, _ := l.IP(to)
	var conn *net.UDPConn
	if err := l.Do(from, func() (err error) {
		conn, err = net.ListenUDP("udp4", &net.UDPAddr{Port: spoofPort + 1})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var replyConn *net.UDPConn
	if err := l.Do(to, func() (err error) {
		replyConn, err = net.ListenUDP("udp4", &net.UDPAddr{Port: spoofPort + 2})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer replyConn.Close()
	src, _ := l.IP(from)
	hits := func() uint64 { return cacheStats(t, l, "h1")["from_container/hit"] }
	before := hits()
	for range 20 {
		conn.WriteToUDP([]byte("warm"), &net.UDPAddr{IP: dst.AsSlice(), Port: spoofPort})
		// The reply of the same flow: from to's spoofPort back to from.
		l.Do(to, func() error {
			return sendRawUDP(dst, src, spoofPort, spoofPort+1, []byte("reply"))
		})
		time.Sleep(20 * time.Millisecond)
	}
	recv()
	if hits() == before {
		t.Fatalf("the flow %s -> %s never took the fast path", from, to)
	}
}

// waitSourcePrograms waits until h1's veth has n programs on its TCX ingress.
func waitSourcePrograms(t *testing.T, l *Lab, veth string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var got int
		if err := l.Do("h1", func() error {
			v, err := netlink.LinkByName(veth)
			if err != nil {
				return err
			}
			filters, err := netlink.FilterList(v, tc.Ingress)
			if err != nil {
				return err
			}
			got = 0
			for _, f := range filters {
				if bf, ok := f.(*netlink.BpfFilter); ok && bf.Name == "skiff-source" {
					got++
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d source check filters on %s's ingress, want %d", got, veth, n)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// sourceEntries counts host's source check entries (its pinned skv_sources).
func sourceEntries(t *testing.T, l *Lab, host string) int {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(l.bpfDir(host), "skv_sources"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	n := 0
	var k uint32
	var v [12]byte
	for it := m.Iterate(); it.Next(&k, &v); {
		n++
	}
	return n
}
