package lab

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os/exec"
	"testing"
	"time"
)

// TestQoS: with the underlay shaped to its rate (--underlay-rate) and two
// containers of one host saturating it, the one of the high class keeps
// the larger share; after both turn normal they share it about evenly.
// Their packets take the cache's path (plain iperf3, no shim), whose
// VXLAN packets skq_underlay marks on the underlay's egress.
func TestQoS(t *testing.T) {
	const rate = 200e6
	l := newLab(t, Config{Name: "tqos", Hosts: 2, ContainersPerHost: 2, Mode: "auto", AgentArgs: []string{"--underlay-rate", "200mbit"}})
	skiff := skiffLimit(t)
	for i, server := range []string{"h2/c1", "h2/c2"} {
		srv, err := l.Command(t.Context(), server, "iperf3", "-4", "-s", "-p", fmt.Sprint(5400+i))
		if err != nil {
			t.Fatal(err)
		}
		startProc(t, srv, false)
	}
	time.Sleep(500 * time.Millisecond)
	// together runs h1/c1 → h2/c1 and h1/c2 → h2/c2 at once for 5 s and
	// returns their goodputs: on the containers' own sockets (the cache's
	// path), or with the shim on host sockets.
	together := func(hostSockets bool) [2]float64 {
		var cmds [2]*exec.Cmd
		var outs [2]bytes.Buffer
		for i := range cmds {
			ns, _ := l.Netns(fmt.Sprintf("h1/c%d", i+1))
			ip, _ := l.IP(fmt.Sprintf("h2/c%d", i+1))
			args := []string{"iperf3", "-4", "-J", "-c", ip.String(), "-p", fmt.Sprint(5400 + i), "-t", "5", "-O", "1"}
			cmds[i] = exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...)
			if hostSockets {
				var err error
				if cmds[i], err = l.Command(t.Context(), fmt.Sprintf("h1/c%d", i+1), args[0], args[1:]...); err != nil {
					t.Fatal(err)
				}
			}
			cmds[i].Stdout = &outs[i]
			if err := cmds[i].Start(); err != nil {
				t.Fatal(err)
			}
		}
		var got [2]float64
		for i, c := range cmds {
			if err := c.Wait(); err != nil {
				t.Fatalf("iperf3 from h1/c%d: %v\n%s", i+1, err, outs[i].String())
			}
			var r struct {
				End struct {
					SumReceived struct {
						BitsPerSecond float64 `json:"bits_per_second"`
					} `json:"sum_received"`
				} `json:"end"`
			}
			if err := json.Unmarshal(outs[i].Bytes(), &r); err != nil {
				t.Fatal(err)
			}
			got[i] = r.End.SumReceived.BitsPerSecond
		}
		return got
	}
	set := func(target, class string) {
		if out, err := skiff("set", l.prefix()+target, "--class", class); err != nil {
			t.Fatalf("skiff limit set --class %s: %v\n%s", class, err, out)
		}
	}
	set("h1-c1", "high")
	set("h1-c2", "low")
	time.Sleep(time.Second)
	before, err := agentOf(t, l, "h1").Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	got := together(false)
	after, err := agentOf(t, l, "h1").Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("underlay at %.0f Mbit/s: high %.1f, low %.1f Mbit/s; %d packets marked", rate/1e6, got[0]/1e6, got[1]/1e6, after.QoS["marked"]-before.QoS["marked"])
	if got[0] < 0.6*rate || got[0] < 2*got[1] || got[0]+got[1] > 1.1*rate {
		t.Errorf("high %.1f and low %.1f Mbit/s on a %.0f Mbit/s underlay: want high >= 60 %% and twice low, the sum within it", got[0]/1e6, got[1]/1e6, rate/1e6)
	}
	if after.QoS["marked"]-before.QoS["marked"] < 1000 {
		t.Errorf("%d packets marked: the test shows nothing of the marking", after.QoS["marked"]-before.QoS["marked"])
	}
	// Host sockets carry the class too (IP_TOS and SO_PRIORITY from sockops).
	got = together(true)
	classed := socketsStatus(t, l, "h1").Counters["limit_classed"]
	t.Logf("host sockets: high %.1f, low %.1f Mbit/s; %d sockets classed", got[0]/1e6, got[1]/1e6, classed)
	if got[0] < 0.6*rate || got[0] < 2*got[1] || classed < 2 {
		t.Errorf("host sockets: high %.1f and low %.1f Mbit/s, %d sockets classed", got[0]/1e6, got[1]/1e6, classed)
	}
	// Both normal again: nothing is marked, and the two share the normal
	// class (one queue: how they split it is TCP's, not skiff's).
	set("h1-c1", "normal")
	set("h1-c2", "normal")
	time.Sleep(time.Second)
	before, err = agentOf(t, l, "h1").Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	got = together(false)
	after, err = agentOf(t, l, "h1").Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("both normal: %.1f and %.1f Mbit/s", got[0]/1e6, got[1]/1e6)
	if marked := after.QoS["marked"] - before.QoS["marked"]; marked != 0 || got[0]+got[1] < 0.8*rate || got[0]+got[1] > 1.1*rate {
		t.Errorf("two normal containers: %.1f and %.1f Mbit/s, %d packets marked; want none marked and the rate used", got[0]/1e6, got[1]/1e6, marked)
	}
}
