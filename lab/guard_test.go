package lab

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/tc/tctest"
)

const metricsPort = 9473

// probeTCP tries a TCP connection to each address and prints one line per
// address: "ADDR open" or "ADDR closed: REASON". Run in a container through
// l.Command, so that in sockets mode it uses the shim's host sockets.
const probeTCP = `
import socket, sys
for a in sys.argv[1:]:
    host, port = a.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, int(port)))
        print(a, "open", flush=True)
    except OSError as e:
        print(a, "closed:", e, flush=True)
    s.close()
`

// TestGuardKeepsContainersFromControlPlane: in every layer, no container
// reaches the cluster store (client and peer ports) or any agent's metrics,
// by any address it can use, while the hosts themselves do.
func TestGuardKeepsContainersFromControlPlane(t *testing.T) {
	for _, mode := range []string{"overlay", "cache", "sockets", "sockets-insecure"} {
		t.Run(mode, func(t *testing.T) {
			args := []string{"--metrics-addr", fmt.Sprintf(":%d", metricsPort)}
			if mode == "sockets-insecure" { // host sockets reach the host's network directly
				mode, args = "sockets", append(args, "--sockets-secure=false")
			}
			l := newLab(t, Config{Name: "tguard", Hosts: 2, ContainersPerHost: 1, Mode: mode, AgentArgs: args})
			// Each address with a host that reaches it: what the containers
			// are refused exists. (Hosts reach each other's control plane by
			// their underlay addresses; over the overlay they are judged
			// like containers.)
			targets := map[netip.AddrPort]string{
				netip.AddrPortFrom(switchAddr, 2379): "h1",
				netip.AddrPortFrom(switchAddr, 2380): "h1",
			}
			for _, h := range l.Hosts {
				targets[netip.AddrPortFrom(h.UnderlayIP, metricsPort)] = "h1"
				targets[netip.AddrPortFrom(cluster.Gateway(hostSubnet(t, l, h.Name)), metricsPort)] = h.Name
			}
			args = nil
			for a, host := range targets {
				c, err := dial(l, host, "tcp4", a, 2*time.Second)
				if err != nil {
					t.Fatalf("host %s cannot reach %s: %v", host, a, err)
				}
				c.Close()
				args = append(args, a.String())
			}
			out := runPy(t, l, "h1/c1", probeTCP, nil, args...)
			for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
				t.Log(line)
				if !strings.Contains(line, " closed: ") {
					t.Errorf("a container reaches the control plane: %s", line)
				}
			}
			if n := len(strings.Split(strings.TrimSpace(out), "\n")); n != len(targets) {
				t.Errorf("probed %d addresses, want %d:\n%s", n, len(targets), out)
			}
		})
	}
}

// hostSubnet returns host's overlay subnet from its agent's status.
func hostSubnet(t *testing.T, l *Lab, host string) netip.Prefix {
	t.Helper()
	st, err := agentOf(t, l, host).Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return st.Host.Subnet
}

// TestGuardDropsForgedVXLAN: a container's VXLAN frame — to another host or
// to its own — never reaches a container with its forged inner source, and
// a host accepts VXLAN only from cluster hosts, and from each only for its
// own containers. A cluster host's frame from its own subnet is delivered:
// the frame is well formed. The case of a host speaking for another's
// subnet (issue 40, item 9a) was delivered before, in every mode.
func TestGuardDropsForgedVXLAN(t *testing.T) {
	for _, mode := range []string{"overlay", "auto"} {
		t.Run(mode, func(t *testing.T) { testForgedVXLAN(t, mode) })
	}
}

func testForgedVXLAN(t *testing.T, mode string) {
	l := newLab(t, Config{Name: "tvxlan", Hosts: 2, ContainersPerHost: 2, Mode: mode})
	const port = 7600
	for _, tc := range []struct {
		from, to, victim, subnet string // subnet: whose the inner source is
		delivered                bool
	}{
		{"h2", "h1", "h1/c2", "h2", true},  // a cluster host for its own: the frame is good
		{"h2", "h1", "h1/c2", "h1", false}, // a cluster host for another's containers
		{"h1/c1", "h2", "h2/c1", "h1", false},
		{"h1/c1", "h1", "h1/c2", "h1", false}, // its own host
		{"switch", "h2", "h2/c1", "h1", false},
	} {
		name := fmt.Sprintf("%s to %s as %s", tc.from, tc.to, tc.subnet)
		victim, _ := l.IP(tc.victim)
		dstHost, _ := l.IP(tc.to)
		spoofed := cluster.Gateway(hostSubnet(t, l, tc.subnet)).Next().Next().Next() // unassigned
		frame := forgedVXLAN(overlay.VTEPMAC(dstHost), spoofed, victim, 0, port, []byte(name))
		var conn *net.UDPConn
		if err := l.Do(tc.victim, func() (err error) {
			conn, err = net.ListenUDP("udp4", &net.UDPAddr{Port: port})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		send := func() error {
			c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: dstHost.AsSlice(), Port: 4789})
			if err != nil {
				return err
			}
			defer c.Close()
			for range 3 {
				if _, err := c.Write(frame); err != nil {
					return err
				}
			}
			return nil
		}
		var err error
		if tc.from == "switch" {
			err = inNetns(l.switchNetns(), send)
		} else {
			err = l.Do(tc.from, send)
		}
		if err != nil {
			t.Fatalf("%s: send: %v", name, err)
		}
		conn.SetReadDeadline(time.Now().Add(time.Second))
		buf := make([]byte, 256)
		n, from, err := conn.ReadFromUDP(buf)
		conn.Close()
		switch {
		case tc.delivered && err != nil:
			t.Errorf("%s: the frame from a cluster host was not delivered: %v", name, err)
		case !tc.delivered && err == nil:
			t.Errorf("%s: forged VXLAN delivered %q to %s as from %s", name, buf[:n], tc.victim, from)
		}
	}
}

// forgedVXLAN builds a VXLAN payload (VNI 1) carrying an Ethernet frame to
// mac with a UDP datagram from src to dst:port with TOS tos.
func forgedVXLAN(mac net.HardwareAddr, src, dst netip.Addr, tos byte, port uint16, payload []byte) []byte {
	ip := tctest.IPv4(tctest.IPOpts{TOS: tos, Frag: 0x4000}, tctest.ProtoUDP, src, dst, tctest.UDP(40000, port, payload))
	return append([]byte{0x08, 0, 0, 0, 0, 0, 1, 0}, tctest.Eth(mac, net.HardwareAddr{2, 0, 0, 0, 0, 1}, 0x0800, ip)...)
}
