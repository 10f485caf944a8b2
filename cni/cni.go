// Package cni is skiff-cni, the CNI plugin: a thin client of skiffd. It
// parses and checks the network configuration, forwards ADD/DEL/CHECK to the
// agent over its Unix socket and turns the answer into a CNI result or a CNI
// error object with the spec's codes.
package cni

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
)

// Codes skiff-cni returns beyond the spec's (the spec leaves 100 and up to
// plugins). Everything else is a spec code: 1, 4 (invalid CNI_CONTAINERID,
// CNI_IFNAME or CNI_NETNS), 3 (CHECK of an unknown container), 6, 7, 11 and
// 50 (README, "CNI error codes").
const (
	// ErrAddressesExhausted: the host's subnet has no free address left.
	ErrAddressesExhausted uint = 100
	// ErrAgentFailed: the agent could not attach, check or detach the
	// container (a kernel or store failure that waiting will not mend); the
	// details say what failed.
	ErrAgentFailed uint = 101
	// ErrCheckFailed: CHECK found the container's address missing from
	// prevResult.
	ErrCheckFailed uint = 102
	// ErrAddressRefused: the address the runtime asked for (ips, IP=) is
	// another container's, or not one of the host's subnet.
	ErrAddressRefused uint = 103
)

// SpecVersions are the CNI spec versions skiff-cni speaks.
var SpecVersions = version.PluginSupports("1.0.0", "1.1.0")

// Funcs are the plugin's commands, for skel.PluginMainFuncs.
var Funcs = skel.CNIFuncs{Add: Add, Del: Del, Check: Check, Status: Status}

// NetConf is skiff-cni's network configuration: the standard keys plus the
// agent's socket. Unknown keys are an error, so a typo does not go unnoticed.
type NetConf struct {
	types.PluginConf
	// IPAM shadows PluginConf's, so that any "ipam" section, whatever its
	// keys, gets the error that says to remove it.
	IPAM          json.RawMessage `json:"ipam,omitempty"`
	RuntimeConfig map[string]any  `json:"runtimeConfig,omitempty"`
	Args          map[string]any  `json:"args,omitempty"`
	// Socket is skiffd's API socket (default /run/skiff/skiffd.sock).
	Socket string `json:"socket,omitempty"`
	// DefaultRoute false leaves the container's default route to another
	// network (skiff as a secondary network): skiff routes the cluster
	// CIDR only. Default true.
	DefaultRoute *bool `json:"defaultRoute,omitempty"`
	// TimeoutSeconds bounds each call to the agent (default 60).
	TimeoutSeconds int `json:"timeoutSeconds,omitempty"`
	// QoS is the QoS class of this network's containers (high, normal or
	// low; CNI_ARGS SKIFF_QOS= sets one container's).
	QoS string `json:"qos,omitempty"`

	limit *cluster.Limit // runtimeConfig.bandwidth, checked by ParseConf
}

// ParseConf decodes and checks a network configuration.
func ParseConf(data []byte) (*NetConf, error) {
	conf := &NetConf{}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(conf); err != nil {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "invalid skiff network configuration", err.Error())
	}
	var ipam map[string]json.RawMessage
	if len(conf.IPAM) > 0 && (json.Unmarshal(conf.IPAM, &ipam) != nil || len(ipam) > 0) {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "invalid skiff network configuration",
			"skiff allocates addresses itself; remove the \"ipam\" section")
	}
	if conf.TimeoutSeconds < 0 {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "invalid skiff network configuration", "timeoutSeconds is negative")
	}
	if conf.TimeoutSeconds == 0 {
		conf.TimeoutSeconds = 60
	}
	if conf.Socket == "" {
		conf.Socket = api.DefaultSocket
	}
	if err := cluster.ValidateClass(conf.QoS); err != nil {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "invalid skiff network configuration", err.Error())
	}
	if v, ok := conf.RuntimeConfig["bandwidth"]; ok {
		var err error
		if conf.limit, err = cluster.LimitFromCNI(v); err != nil {
			return nil, types.NewError(types.ErrInvalidNetworkConfig, "invalid skiff network configuration", "runtimeConfig."+err.Error())
		}
	}
	for _, key := range []string{"cgroupPath", "mac"} {
		if v, ok := conf.RuntimeConfig[key]; ok {
			if _, isString := v.(string); !isString {
				return nil, types.NewError(types.ErrInvalidNetworkConfig, "invalid skiff network configuration",
					fmt.Sprintf("runtimeConfig.%s is %T, not a string", key, v))
			}
		}
	}
	return conf, nil
}

// Asked is the address and MAC the runtime asks for, from the ips and mac
// capabilities (runtimeConfig) or CNI_ARGS IP= and MAC= (podman --ip and
// --mac-address, either way); unset when it asks for none.
type Asked struct {
	IP    netip.Addr
	MAC   net.HardwareAddr
	Class string       // QoS class: CNI_ARGS SKIFF_QOS=, else the network's
	Pod   *cluster.Pod // CNI_ARGS K8S_POD_NAMESPACE=, K8S_POD_NAME=, K8S_POD_UID= (the kubelet's)
}

// asked reads what the runtime asks for. A malformed value, an IPv6
// address, or more than one address is an error (invalid network
// configuration): skiff gives each container one IPv4 address.
func (c *NetConf) asked(cniArgs string) (Asked, error) {
	var ips []string
	var mac string
	if v, ok := c.RuntimeConfig["ips"]; ok {
		list, isList := v.([]any)
		if !isList {
			return Asked{}, fmt.Errorf("runtimeConfig.ips is %T, not a list", v)
		}
		for _, x := range list {
			s, isString := x.(string)
			if !isString {
				return Asked{}, fmt.Errorf("runtimeConfig.ips holds %T, not a string", x)
			}
			ips = append(ips, s)
		}
	}
	mac, _ = c.RuntimeConfig["mac"].(string)
	class := c.QoS
	var pod cluster.Pod
	for _, kv := range strings.Split(cniArgs, ";") {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "IP":
			ips = append(ips, strings.Split(v, ",")...)
		case "MAC":
			mac = cmp.Or(mac, v)
		case "SKIFF_QOS":
			class = v
		case "K8S_POD_NAMESPACE":
			pod.Namespace = v
		case "K8S_POD_NAME":
			pod.Name = v
		case "K8S_POD_UID":
			pod.UID = v
		}
	}
	a := Asked{Class: class}
	if err := cluster.ValidateClass(class); err != nil {
		return Asked{}, err
	}
	// A pod is named by its namespace and name together (the kubelet
	// passes both); one alone names none.
	if pod.Namespace != "" && pod.Name != "" {
		if err := pod.Validate(); err != nil {
			return Asked{}, fmt.Errorf("CNI_ARGS: %w", err)
		}
		a.Pod = &pod
	}
	for _, s := range ips {
		s, _, _ = strings.Cut(s, "/") // the length is the subnet's
		ip, err := netip.ParseAddr(s)
		switch {
		case err != nil:
			return Asked{}, fmt.Errorf("address %q: %w", s, err)
		case !ip.Is4():
			return Asked{}, fmt.Errorf("address %s: skiff gives containers IPv4 addresses only", ip)
		case a.IP.IsValid() && a.IP != ip:
			return Asked{}, fmt.Errorf("addresses %s and %s: skiff gives a container one address per network", a.IP, ip)
		}
		a.IP = ip
	}
	if mac != "" {
		hw, err := cluster.ParseMAC(mac)
		if err != nil {
			return Asked{}, err
		}
		a.MAC = hw
	}
	return a, nil
}

// Cgroup is the container's cgroup the runtime passed (CNI cgroupPath
// capability); sockets mode replaces the sockets of processes in it.
func (c *NetConf) Cgroup() string {
	s, _ := c.RuntimeConfig["cgroupPath"].(string)
	return s
}

// ValidateArgs checks the runtime's CNI_CONTAINERID, CNI_IFNAME and
// CNI_NETNS as libcni does, before the agent is asked anything: error 4,
// "invalid necessary environment variables". DEL may come without a netns.
func ValidateArgs(args *skel.CmdArgs, del bool) error {
	bad := func(what string, err error) error {
		return types.NewError(types.ErrInvalidEnvironmentVariables, "invalid "+what, err.Error())
	}
	if err := cluster.ValidateContainerID(args.ContainerID); err != nil {
		return bad("CNI_CONTAINERID", err)
	}
	if err := cluster.ValidateIfName(args.IfName); err != nil {
		return bad("CNI_IFNAME", err)
	}
	if del && args.Netns == "" {
		return nil
	}
	if err := cluster.ValidateNetns(args.Netns); err != nil {
		return bad("CNI_NETNS", err)
	}
	return nil
}

func setup(args *skel.CmdArgs) (*NetConf, *api.Client, context.Context, context.CancelFunc, error) {
	conf, err := ParseConf(args.StdinData)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(conf.TimeoutSeconds)*time.Second)
	return conf, api.NewClient(conf.Socket), ctx, cancel, nil
}

// cniError turns an agent failure into a CNI error object.
func cniError(op string, err error) error {
	var apiErr *api.Error
	switch {
	case errors.Is(err, api.ErrAgentUnreachable):
		return types.NewError(types.ErrTryAgainLater, "skiffd is not running or not reachable; try again later", err.Error())
	case errors.As(err, &apiErr) && apiErr.Retry:
		return types.NewError(types.ErrTryAgainLater, op+": the agent cannot do this right now; try again later", apiErr.Message)
	case errors.As(err, &apiErr) && apiErr.Status == http.StatusBadRequest:
		return types.NewError(types.ErrInvalidEnvironmentVariables, op+": the agent rejected the request", apiErr.Message)
	case errors.As(err, &apiErr) && apiErr.Status == http.StatusNotFound:
		return types.NewError(types.ErrUnknownContainer, op+": the agent has no such container", apiErr.Message)
	case errors.As(err, &apiErr) && apiErr.Status == http.StatusConflict:
		return types.NewError(ErrAddressRefused, op+": the address asked for cannot be given", apiErr.Message)
	case errors.As(err, &apiErr) && apiErr.Status == http.StatusInsufficientStorage:
		return types.NewError(ErrAddressesExhausted, op+": no free address on this host", apiErr.Message)
	default:
		return types.NewError(ErrAgentFailed, op+" failed", err.Error())
	}
}

// Add attaches the container and prints the CNI result.
func Add(args *skel.CmdArgs) error {
	conf, client, ctx, cancel, err := setup(args)
	if err != nil {
		return err
	}
	if err := ValidateArgs(args, false); err != nil {
		return err
	}
	defer cancel()
	asked, err := conf.asked(args.Args)
	if err != nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "invalid address, MAC or QoS class asked for", err.Error())
	}
	req := api.AddRequest{ContainerID: args.ContainerID, IfName: args.IfName, Netns: args.Netns, Cgroup: conf.Cgroup(), IP: asked.IP,
		ClusterRoute: conf.DefaultRoute != nil && !*conf.DefaultRoute}
	if conf.limit != nil {
		req.Limit = conf.limit.Clamp()
	}
	req.Limit.Class = asked.Class
	req.Pod = asked.Pod
	if asked.MAC != nil {
		req.MAC = asked.MAC.String()
	}
	nsFile := openNetns(args.Netns, &req)
	defer nsFile.Close()
	att, err := client.AddEndpoint(ctx, req)
	if err != nil {
		return cniError("attach container", err)
	}
	res, err := Result(att, args.Netns)
	if err != nil {
		return types.NewError(ErrAgentFailed, "build result", err.Error())
	}
	return types.PrintResult(res, conf.CNIVersion)
}

// openNetns opens the runtime's namespace path and puts the descriptor in
// req (NetnsFD): skiffd reaches the namespace through it (as
// /proc/<this pid>/fd/<fd>, the pid from the socket's credentials) when the
// path means nothing in its own mount namespace — a runtime under
// ip netns exec, rootless, in a container, with PrivateMounts. The file
// must stay open until the agent has answered. An unopenable path is left
// to the agent to judge (nil file; Close on nil is fine).
func openNetns(path string, req *api.AddRequest) *os.File {
	if path == "" {
		return nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	req.NetnsFD = int(f.Fd())
	return f
}

// Result builds the CNI result for an attachment: the host veth, the
// container interface, its address and the default route.
func Result(att api.Attachment, netns string) (*current.Result, error) {
	gw := net.ParseIP(att.Gateway)
	if gw == nil {
		return nil, fmt.Errorf("agent returned gateway %q", att.Gateway)
	}
	ip := att.Endpoint.IP
	idx := 1
	dst := net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
	if att.Endpoint.ClusterRoute {
		cidr, err := netip.ParsePrefix(att.ClusterCIDR)
		if err != nil {
			return nil, fmt.Errorf("agent returned cluster CIDR %q", att.ClusterCIDR)
		}
		dst = net.IPNet{IP: cidr.Masked().Addr().AsSlice(), Mask: net.CIDRMask(cidr.Bits(), 32)}
	}
	return &current.Result{
		CNIVersion: current.ImplementedSpecVersion,
		Interfaces: []*current.Interface{
			{Name: att.Endpoint.Veth, Mac: att.HostVethMAC},
			{Name: att.Endpoint.IfName, Mac: att.ContainerMAC, Mtu: att.MTU, Sandbox: netns},
		},
		IPs: []*current.IPConfig{{
			Interface: &idx,
			Address:   net.IPNet{IP: ip.Addr().AsSlice(), Mask: net.CIDRMask(ip.Bits(), 32)},
			Gateway:   gw,
		}},
		Routes: []*types.Route{{Dst: dst, GW: gw}},
	}, nil
}

// Del detaches the container; a container that is already gone is success.
func Del(args *skel.CmdArgs) error {
	_, client, ctx, cancel, err := setup(args)
	if err != nil {
		return err
	}
	if err := ValidateArgs(args, true); err != nil {
		return err
	}
	defer cancel()
	req := api.AddRequest{ContainerID: args.ContainerID, IfName: args.IfName, Netns: args.Netns}
	if err := client.DeleteEndpoint(ctx, req); err != nil {
		return cniError("detach container", err)
	}
	return nil
}

// Check verifies the attachment against the agent and the previous result.
func Check(args *skel.CmdArgs) error {
	conf, client, ctx, cancel, err := setup(args)
	if err != nil {
		return err
	}
	if err := ValidateArgs(args, false); err != nil {
		return err
	}
	defer cancel()
	if conf.RawPrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "CHECK needs prevResult", "the runtime passed no prevResult")
	}
	if err := version.ParsePrevResult(&conf.PluginConf); err != nil {
		return types.NewError(types.ErrDecodingFailure, "decode prevResult", err.Error())
	}
	prev, err := current.NewResultFromResult(conf.PrevResult)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, "convert prevResult", err.Error())
	}
	req := api.AddRequest{ContainerID: args.ContainerID, IfName: args.IfName, Netns: args.Netns}
	nsFile := openNetns(args.Netns, &req)
	defer nsFile.Close()
	att, err := client.CheckEndpoint(ctx, req)
	if err != nil {
		return cniError("check container", err)
	}
	for _, ip := range prev.IPs {
		if ip.Address.String() == att.Endpoint.IP.String() {
			return nil
		}
	}
	return types.NewError(ErrCheckFailed, "check container", fmt.Sprintf("prevResult does not hold the container's address %s", att.Endpoint.IP))
}

// Status reports whether the plugin can serve ADD now.
func Status(args *skel.CmdArgs) error {
	_, client, ctx, cancel, err := setup(args)
	if err != nil {
		return err
	}
	defer cancel()
	st, err := client.Status(ctx)
	if err != nil {
		return types.NewError(types.ErrPluginNotAvailable, "skiffd is not reachable", err.Error())
	}
	if !st.Ready {
		return types.NewError(types.ErrPluginNotAvailable, "skiffd is not ready",
			fmt.Sprintf("store reachable: %v %s; last sync error: %s", st.StoreReachable, st.StoreError, st.SyncError))
	}
	return nil
}

// ConflistName is the network configuration skiff installs.
const ConflistName = "10-skiff.conflist"

// Conflist is skiff's network configuration list (deploy/cni/10-skiff.conflist):
// skiff-cni with the runtime's capabilities it takes, then portmap for
// published ports.
const Conflist = `{
  "cniVersion": "1.0.0",
  "name": "skiff",
  "plugins": [
    {
      "type": "skiff-cni",
      "capabilities": {"cgroupPath": true, "ips": true, "mac": true, "bandwidth": true}
    },
    {
      "type": "portmap",
      "snat": true,
      "capabilities": {"portMappings": true}
    }
  ]
}
`
