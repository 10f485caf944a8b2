// Package cluster holds skiff's domain types — the cluster configuration,
// hosts and container endpoints — with no dependencies, so that light
// programs (the CNI plugin) can share them with the agent and the store.
package cluster

import (
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"time"
)

// Config is the cluster-wide configuration, written once by the first agent.
type Config struct {
	CIDR       netip.Prefix `json:"cidr"`
	HostPrefix int          `json:"hostPrefix"` // per-host subnet length, e.g. 24
	VNI        int          `json:"vni"`
	VXLANPort  int          `json:"vxlanPort"`
}

// Validate checks that c describes a usable overlay.
func (c Config) Validate() error {
	if !c.CIDR.IsValid() || !c.CIDR.Addr().Is4() || c.CIDR != c.CIDR.Masked() {
		return fmt.Errorf("cluster CIDR %q must be an IPv4 network address such as 10.244.0.0/16", c.CIDR)
	}
	if c.HostPrefix <= c.CIDR.Bits() || c.HostPrefix > 28 {
		return fmt.Errorf("host subnet length /%d must be longer than the cluster CIDR /%d and at most /28", c.HostPrefix, c.CIDR.Bits())
	}
	if c.VNI < 1 || c.VNI > 1<<24-1 {
		return fmt.Errorf("VNI %d out of range 1-16777215", c.VNI)
	}
	if c.VXLANPort < 1 || c.VXLANPort > 65535 {
		return fmt.Errorf("VXLAN port %d out of range", c.VXLANPort)
	}
	return nil
}

// Host is one member of the
type Host struct {
	Name       string       `json:"name"`
	UnderlayIP netip.Addr   `json:"underlayIP"`
	Subnet     netip.Prefix `json:"subnet"`
	VTEPMAC    string       `json:"vtepMAC"`
	// Control is what the host serves to the cluster's control plane (its
	// embedded etcd, its metrics), published so that every host keeps its
	// containers away from it. An unspecified address means all of the
	// host's addresses.
	Control []netip.AddrPort `json:"control,omitempty"`
	// Features are what the host's data plane offers its peers beyond the
	// overlay (cache.FeatureRewrite: it restores rewritten packets).
	Features []string `json:"features,omitempty"`
}

// Equal reports whether h and o are the same record.
func (h Host) Equal(o Host) bool {
	return h.Name == o.Name && h.UnderlayIP == o.UnderlayIP && h.Subnet == o.Subnet && h.VTEPMAC == o.VTEPMAC &&
		slices.Equal(h.Control, o.Control) && slices.Equal(h.Features, o.Features)
}

// Endpoint is one container interface attached to the overlay.
type Endpoint struct {
	ContainerID string       `json:"containerID"`
	IfName      string       `json:"ifName"`
	Host        string       `json:"host"`
	IP          netip.Prefix `json:"ip"` // address with the host subnet's length
	Veth        string       `json:"veth"`
	Netns       string       `json:"netns"`
	// NetnsDev and NetnsIno identify the namespace ADD configured (its
	// nsfs device and inode, as stat(2) reports them): skiff enters Netns
	// only while the path still names that namespace, never one a reused
	// /proc/PID/ns/net or a new mount put there. Zero: unknown (a record
	// written by an older build).
	NetnsDev uint64 `json:"netnsDev,omitempty"`
	NetnsIno uint64 `json:"netnsIno,omitempty"`
	// NetnsHidden: Netns names nothing in skiffd's mount namespace (the
	// runtime runs in another one); skiffd reached the namespace through
	// the plugin's open descriptor and cannot enter it afterwards. It does
	// not judge such an endpoint gone: the runtime's DEL removes it.
	NetnsHidden bool      `json:"netnsHidden,omitempty"`
	MAC         string    `json:"mac,omitempty"`
	Created     time.Time `json:"created"`
	// Cgroup is the container's cgroup v2 (CNI cgroupPath): in sockets
	// mode its sockets are replaced by host sockets. Empty: overlay only.
	Cgroup string `json:"cgroup,omitempty"`
	// Limit is the container's rate limit (CNI bandwidth); zero: none.
	Limit Limit `json:"limit,omitzero"`
	// ClusterRoute: the container reaches the overlay by a route for the
	// cluster CIDR, not its default route (a secondary network, CNI
	// "defaultRoute": false).
	ClusterRoute bool `json:"clusterRoute,omitempty"`
	// Pod is the Kubernetes pod the container belongs to, as the kubelet
	// names it (CNI_ARGS K8S_POD_*); nil outside Kubernetes.
	Pod *Pod `json:"pod,omitempty"`
}

// Pod names a Kubernetes pod.
type Pod struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid,omitempty"`
}

var (
	podNamespace = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)                   // a DNS-1123 label
	podName      = regexp.MustCompile(`^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$`)                 // a DNS-1123 subdomain
	podUID       = regexp.MustCompile(`^[0-9a-fA-F]{8}-?([0-9a-fA-F]{4}-?){3}[0-9a-fA-F]{12}$`) // a UUID
)

// Equal says whether p and o name the same pod (or both none).
func (p *Pod) Equal(o *Pod) bool {
	return p == nil && o == nil || p != nil && o != nil && *p == *o
}

// Validate reports the first thing wrong with p, as Kubernetes would.
func (p Pod) Validate() error {
	switch {
	case !podNamespace.MatchString(p.Namespace):
		return fmt.Errorf("pod namespace %q is not a DNS-1123 label", p.Namespace)
	case !podName.MatchString(p.Name):
		return fmt.Errorf("pod name %q is not a DNS-1123 subdomain", p.Name)
	case p.UID != "" && !podUID.MatchString(p.UID):
		return fmt.Errorf("pod UID %q is not a UUID", p.UID)
	}
	return nil
}

// LimitOverride is a rate limit set with skiff limit for one endpoint: it
// takes the place of the limit the runtime asked for (Endpoint.Limit)
// until it is deleted, or the endpoint is.
type LimitOverride struct {
	Host        string `json:"host"`
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifName"`
	Limit       Limit  `json:"limit"`
}

// Equal says whether e and o are the same endpoint, their creation times
// compared by instant (a decoded time's location may differ).
func (e Endpoint) Equal(o Endpoint) bool {
	if !e.Created.Equal(o.Created) {
		return false
	}
	e.Created, o.Created = time.Time{}, time.Time{}
	return e == o
}

// Listener is a replaced listener (sockets mode): an overlay address and
// port served by a host socket on Host. Clients take the fast path only to
// published listeners; anything else is reached through the overlay.
type Listener struct {
	Host string         `json:"host"`
	Addr netip.AddrPort `json:"addr"`
}

// Gateway is the bridge address of a host subnet (.1).
func Gateway(subnet netip.Prefix) netip.Addr { return subnet.Masked().Addr().Next() }

// ContainerAddrs are the addresses containers may use in a host subnet:
// all but the network address (VTEP), the gateway and the broadcast
// address, in order.
func ContainerAddrs(subnet netip.Prefix) []netip.Addr {
	var out []netip.Addr
	last := Broadcast(subnet)
	for a := Gateway(subnet).Next(); a.Less(last); a = a.Next() {
		out = append(out, a)
	}
	return out
}

// Broadcast is a subnet's last address.
func Broadcast(subnet netip.Prefix) netip.Addr {
	a := subnet.Masked().Addr().As4()
	for i := subnet.Bits(); i < 32; i++ {
		a[i/8] |= 0x80 >> (i % 8)
	}
	return netip.AddrFrom4(a)
}

// VTEPAddr is the overlay address of a host's VXLAN device: the subnet's
// network address, as in Flannel, so the neighbour entry for a remote host can
// be derived from its subnet alone.
func VTEPAddr(subnet netip.Prefix) netip.Addr { return subnet.Masked().Addr() }

// UnderlayFault says why addr cannot be a host's underlay address ("": it
// can). Every host accepts VXLAN from every other host's underlay address
// and routes its subnet there, so a record's address is only believed when
// it can be one machine's own unicast address outside the overlay.
func UnderlayFault(a netip.Addr, cidr netip.Prefix) string {
	switch {
	case !a.IsValid() || !a.Is4():
		return "not an IPv4 address"
	case a.IsUnspecified():
		return "unspecified"
	case a.IsLoopback():
		return "loopback"
	case a.IsMulticast(), a == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "multicast or broadcast"
	case a.IsLinkLocalUnicast():
		return "link-local"
	case cidr.IsValid() && cidr.Contains(a):
		return "inside the cluster's range " + cidr.String()
	}
	return ""
}
