package lab

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
)

// runtimeAdd makes a namespace l.prefix()+name and attaches it through
// libcni as a runtime would (interface ifName, capability arguments caps,
// CNI_ARGS args); the test's end detaches and deletes it. It returns the
// result and the runtime configuration (for DEL and CHECK).
func runtimeAdd(t *testing.T, cc *libcni.CNIConfig, list *libcni.NetworkConfigList, l *Lab, name, ifName string, caps map[string]any, args [][2]string) (*current.Result, *libcni.RuntimeConf, error) {
	t.Helper()
	ns := l.prefix() + name
	if err := addNetns(ns); err != nil {
		t.Fatal(err)
	}
	rc := &libcni.RuntimeConf{ContainerID: ns, NetNS: NetnsPath(ns), IfName: ifName, CapabilityArgs: caps, Args: args}
	t.Cleanup(func() {
		cc.DelNetworkList(context.Background(), list, rc)
		run("ip", "netns", "del", ns)
	})
	res, err := cc.AddNetworkList(context.Background(), list, rc)
	if err != nil {
		return nil, rc, err
	}
	cur, err := current.NewResultFromResult(res)
	return cur, rc, err
}

// TestAskedAddress: a runtime's --ip and --mac-address (the CNI ips and mac
// capabilities, and CNI_ARGS IP=/MAC=) are honoured: the container gets
// them and is reachable; another container asking for the same address, or
// for one outside its host's subnet, gets a clear error (code 103) and
// nothing is left behind. Before, they were ignored.
func TestAskedAddress(t *testing.T) {
	l := newLab(t, Config{Name: "tasked", Hosts: 2, ContainersPerHost: 1, Mode: "overlay"})
	ctx := context.Background()
	cc, list, err := l.cni("h1")
	if err != nil {
		t.Fatal(err)
	}
	st, err := agentOf(t, l, "h1").Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	subnet := st.Host.Subnet
	ip := subnet.Masked().Addr().Next().Next().Next().Next().Next().Next().Next() // .7
	mac := "02:42:0a:f4:00:07"
	add := func(name string, caps map[string]any, args [][2]string) (*current.Result, *libcni.RuntimeConf, error) {
		return runtimeAdd(t, cc, list, l, name, "eth0", caps, args)
	}
	res, _, err := add("ask1", map[string]any{"ips": []string{ip.String() + "/24"}, "mac": mac}, nil)
	if err != nil {
		t.Fatalf("ADD asking for %s and %s: %v", ip, mac, err)
	}
	if got := res.IPs[0].Address.IP.String(); got != ip.String() || res.Interfaces[1].Mac != mac {
		t.Fatalf("got %s %s, want %s %s", got, res.Interfaces[1].Mac, ip, mac)
	}
	if err := run("ip", "netns", "exec", l.prefix()+"ask1", "sh", "-c", "ip link show eth0 | grep -q "+mac); err != nil {
		t.Errorf("the container's interface: %v", err)
	}
	peer, _ := l.IP("h2/c1")
	if err := run("ip", "netns", "exec", l.prefix()+"ask1", "ping", "-c", "1", "-W", "2", peer.String()); err != nil {
		t.Errorf("from the asked-for address: %v", err)
	}
	// podman's CNI_ARGS form.
	ip2 := ip.Next()
	res, _, err = add("ask2", nil, [][2]string{{"IgnoreUnknown", "1"}, {"IP", ip2.String()}, {"MAC", "02:42:0a:f4:00:08"}})
	if err != nil || res.IPs[0].Address.IP.String() != ip2.String() || res.Interfaces[1].Mac != "02:42:0a:f4:00:08" {
		t.Fatalf("CNI_ARGS IP=%s: %v %v", ip2, res, err)
	}
	outside := netip.MustParseAddr("10.244.200.5")
	for name, asked := range map[string]netip.Addr{"ask3": ip, "ask4": outside} {
		_, rc, err := add(name, map[string]any{"ips": []string{asked.String()}}, nil)
		var cniErr *types.Error
		if !errors.As(err, &cniErr) || cniErr.Code != 103 || !strings.Contains(cniErr.Details, asked.String()) {
			t.Errorf("ADD asking for %s: %v, want error 103 naming it", asked, err)
		}
		if err := run("ip", "netns", "exec", rc.ContainerID, "ip", "link", "show", "eth0"); err == nil {
			t.Errorf("the refused ADD of %s left an interface", name)
		}
	}
	eps, err := agentOf(t, l, "h1").Endpoints(ctx, false)
	if err != nil || len(eps) != 3 {
		t.Errorf("endpoints after the refused ADDs: %d (%v), want 3", len(eps), err)
	}
	// The kubelet's CNI_ARGS name the pod, and its endpoint records it; a
	// malformed name is refused.
	pod := cluster.Pod{Namespace: "prod", Name: "web-0", UID: "3c0f4c4e-8a49-4f3a-9e0e-2a1b7c2d9f10"}
	kubelet := func(name string) [][2]string {
		return [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", pod.Namespace}, {"K8S_POD_NAME", name},
			{"K8S_POD_INFRA_CONTAINER_ID", "0123abcd"}, {"K8S_POD_UID", pod.UID}}
	}
	_, rc, err := add("ask5", nil, kubelet(pod.Name))
	if err != nil {
		t.Fatalf("ADD with the kubelet's CNI_ARGS: %v", err)
	}
	eps, err = agentOf(t, l, "h1").Endpoints(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	if i := slices.IndexFunc(eps, func(e api.EndpointStatus) bool { return e.ContainerID == rc.ContainerID }); i < 0 || !eps[i].Pod.Equal(&pod) {
		t.Errorf("the pod's endpoint does not name it (%+v)", eps)
	}
	if _, _, err := add("ask6", nil, kubelet("Web_0")); err == nil || !strings.Contains(err.Error(), "DNS-1123") {
		t.Errorf("ADD naming pod Web_0: %v, want an error", err)
	}
	secondaryNetwork(t, l, cc, peer)
}

// secondaryNetwork: with "defaultRoute": false skiff routes only the
// cluster CIDR, leaving the container's default route to another network.
func secondaryNetwork(t *testing.T, l *Lab, cc *libcni.CNIConfig, peer netip.Addr) {
	t.Helper()
	data, err := l.ConfList("h1")
	if err != nil {
		t.Fatal(err)
	}
	var conf map[string]any
	json.Unmarshal(data, &conf)
	conf["plugins"].([]any)[0].(map[string]any)["defaultRoute"] = false
	data, _ = json.Marshal(conf)
	list, err := libcni.ConfListFromBytes(data)
	if err != nil {
		t.Fatal(err)
	}
	cur, rc, err := runtimeAdd(t, cc, list, l, "second", "net1", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ns := rc.ContainerID
	if len(cur.Routes) != 1 || cur.Routes[0].Dst.String() != l.Config.ClusterCIDR {
		t.Errorf("result routes %v, want the cluster CIDR %s only", cur.Routes, l.Config.ClusterCIDR)
	}
	out, err := exec.Command("ip", "netns", "exec", ns, "ip", "-4", "route").CombinedOutput()
	if err != nil || strings.Contains(string(out), "default") || !strings.Contains(string(out), l.Config.ClusterCIDR+" via") {
		t.Errorf("routes of a secondary network's container (%v):\n%s", err, out)
	}
	if err := run("ip", "netns", "exec", ns, "ping", "-c", "1", "-W", "2", peer.String()); err != nil {
		t.Errorf("secondary network: %v", err)
	}
	if err := cc.CheckNetworkList(context.Background(), list, rc); err != nil {
		t.Errorf("CHECK: %v", err)
	}
}

// TestPortMapping: a runtime's -p (the portMappings capability) publishes a
// container's port on its host's address through the reference portmap
// plugin, chained after skiff-cni as the lab's (and README's) conflist
// does; DEL takes it away. The plugin runs in the lab host's namespace.
// A container of the same host reaches a published UDP port too, and
// hears the answer from the published address.
func TestPortMapping(t *testing.T) {
	if portmapDir() == "" {
		t.Fatal("the portmap plugin is not installed (make deps installs containernetworking-plugins)")
	}
	l := newLab(t, Config{Name: "tportmap", Hosts: 2, ContainersPerHost: 1, Mode: "auto"})
	ctx := context.Background()
	cc, list, err := l.cni("h1")
	if err != nil {
		t.Fatal(err)
	}
	_, rc, err := runtimeAdd(t, cc, list, l, "pm", "eth0",
		map[string]any{"portMappings": []map[string]any{{"hostPort": 8080, "containerPort": 7000, "protocol": "tcp"},
			{"hostPort": 8081, "containerPort": 7001, "protocol": "udp"}}}, nil)
	if err != nil {
		t.Fatalf("ADD with a port mapping: %v", err)
	}
	ns := rc.ContainerID
	var ln net.Listener
	if err := inNetns(ns, func() (err error) { ln, err = net.Listen("tcp4", ":7000"); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go echoTCP(ln)
	h1, _ := l.IP("h1")
	published := netip.AddrPortFrom(h1, 8080)
	if err := exchange(l, "h2", "tcp4", published); err != nil {
		t.Fatalf("h2 -> %s (the container's port 7000): %v", published, err)
	}
	var pc net.PacketConn
	if err := inNetns(ns, func() (err error) { pc, err = net.ListenPacket("udp4", ":7001"); return err }); err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	go echoUDP(pc)
	if err := queryUnconnected(l, "h1/c1", netip.AddrPortFrom(h1, 8081), 20); err != nil {
		t.Errorf("h1/c1 to the published UDP port: %v", err)
	}
	if err := cc.DelNetworkList(ctx, list, rc); err != nil {
		t.Fatal(err)
	}
	if err := exchange(l, "h2", "tcp4", published); err == nil {
		t.Error("the port is still published after DEL")
	}
}
