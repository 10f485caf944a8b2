// Package api is the local API of skiffd: JSON over HTTP on a Unix socket,
// used by the CNI plugin and the CLI. The client maps transport failures to
// ErrAgentUnreachable and agent answers to typed errors.
package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"time"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
)

// DefaultSocket is where skiffd listens unless told otherwise.
const DefaultSocket = "/run/skiff/skiffd.sock"

// AddRequest asks the agent to attach a container to the overlay.
type AddRequest struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifName"`
	Netns       string `json:"netns"`
	// Cgroup is the container's cgroup (CNI cgroupPath), for sockets mode.
	Cgroup string `json:"cgroup,omitempty"`
	// IP and MAC are what the runtime asks for (CNI ips and mac, IP= and
	// MAC=); unset: skiff chooses.
	IP  netip.Addr `json:"ip,omitzero"`
	MAC string     `json:"mac,omitempty"`
	// NetnsFD is the plugin's open descriptor of Netns: the agent reaches
	// the namespace through /proc/<plugin pid>/fd/<NetnsFD> when Netns
	// does not name it in the agent's mount namespace. 0: none.
	NetnsFD int `json:"netnsFD,omitempty"`
	// Limit is the rate limit the runtime asks for (CNI bandwidth).
	Limit cluster.Limit `json:"limit,omitzero"`
	// ClusterRoute leaves the container's default route alone (a
	// secondary network): it reaches the overlay by a route for the
	// cluster CIDR.
	ClusterRoute bool `json:"clusterRoute,omitempty"`
}

// Attachment is what the agent built for a container: the data a CNI result
// needs.
type Attachment struct {
	Endpoint     cluster.Endpoint `json:"endpoint"`
	Gateway      string           `json:"gateway"`
	MTU          int              `json:"mtu"`
	HostVethMAC  string           `json:"hostVethMAC"`
	ContainerMAC string           `json:"containerMAC"`
	ClusterCIDR  string           `json:"clusterCIDR"`
}

// Status describes the agent and its host.
type Status struct {
	Host    cluster.Host   `json:"host"`
	Cluster cluster.Config `json:"cluster"`
	Mode    string         `json:"mode"`
	// Layers is every layer skiffd knows: on, or off and why.
	Layers         []Layer `json:"layers"`
	StoreReachable bool    `json:"storeReachable"`
	StoreError     string  `json:"storeError,omitempty"`
	// Ready: the store answers, holds this host, and the last sync with
	// it (since the connection to it was last lost) succeeded.
	Ready       bool      `json:"ready"`
	Endpoints   int       `json:"endpoints"`
	RemoteHosts int       `json:"remoteHosts"`
	LastSync    time.Time `json:"lastSync"`
	SyncError   string    `json:"syncError,omitempty"`
	Version     string    `json:"version"`
	// Reconciles counts the reconciles since start; ReconcileEventsHeld
	// the store watch events folded into a later one (paced: at most one
	// watch-triggered reconcile per 100 ms).
	Reconciles          uint64 `json:"reconciles"`
	ReconcileEventsHeld uint64 `json:"reconcileEventsHeld"`
	// Cache holds the fast path's counters (program/outcome → packets)
	// when the cache layer runs.
	Cache map[string]uint64 `json:"cache,omitempty"`
	// Sockets holds the sockets layer's counters and its containers when
	// it runs.
	Sockets *SocketsStatus `json:"sockets,omitempty"`
	// SourceDrops counts, by reason, the packets containers sent that the
	// source check on their veths dropped (every mode).
	SourceDrops map[string]uint64 `json:"sourceDrops,omitempty"`
	// Channels is the channels layer's, when it runs.
	Channels *ChannelsStatus `json:"channels,omitempty"`
	// Steering is the steering layer's, when it runs.
	Steering *SteeringStatus `json:"steering,omitempty"`
	// QoS counts the underlay packets of QoS-classed containers marked
	// (marked) and the overlay packets of normal ones (unclassed).
	QoS map[string]uint64 `json:"qos,omitempty"`
}

// EndpointStatus is an endpoint and, on its own host, which layers carry
// its traffic (on) and why the others do not.
type EndpointStatus struct {
	cluster.Endpoint // its Limit is the one in force
	// LimitSet: the limit was set with skiff limit, not by the runtime.
	LimitSet bool    `json:"limitSet,omitempty"`
	Layers   []Layer `json:"layers,omitempty"`
}

// Paths lists the layers that carry e besides the overlay, and why each
// other one does not ("sockets: no cgroupPath from the runtime").
func (e EndpointStatus) Paths() (on, off []string) {
	for _, l := range e.Layers {
		if l.On {
			on = append(on, l.Name)
		} else {
			off = append(off, l.Name+": "+l.Reason)
		}
	}
	return on, off
}

// Layer is one data-plane layer of a host (docs/layers.md).
type Layer struct {
	Name   string `json:"name"`
	On     bool   `json:"on"`
	Reason string `json:"reason,omitempty"` // why it is off
}

// SteeringStatus is the steering layer of one host: the CPUs the stages
// of overlay flows are spread over, the two-choice threshold, each
// stage's packets per CPU (where it ran), the decisions by reason, and
// each CPU's load as last sampled (percent).
type SteeringStatus struct {
	CPUs      []int             `json:"cpus"`
	Threshold int               `json:"threshold"`
	Stages    []SteeringStage   `json:"stages"`
	Decisions map[string]uint64 `json:"decisions"`
	Load      map[int]uint32    `json:"load,omitempty"`
}

// SteeringStage is one stage of the overlay's receive path: its device
// and the packets it processed on each CPU.
type SteeringStage struct {
	Name    string   `json:"name"`
	Device  string   `json:"device"`
	Packets []uint64 `json:"packets"` // by CPU
}

// ChannelsStatus is the channels layer of one host: its programs'
// counters (channels.Counters) and the sockets in its map now (two a
// channelled connection).
type ChannelsStatus struct {
	Counters map[string]uint64 `json:"counters"`
	Sockets  int               `json:"sockets"`
}

// SocketsStatus is the sockets layer of one host.
type SocketsStatus struct {
	Counters   map[string]uint64  `json:"counters"`
	Listeners  []string           `json:"listeners"` // overlay address:port of replaced listeners
	Containers []SocketsContainer `json:"containers"`
	Policy     *SocketsPolicy     `json:"policy"` // null: none in force, every connection takes the overlay
	// ListenerQuota is the ports each container's host sockets may hold.
	ListenerQuota int `json:"listenerQuota"`
	// RoutesOver counts the cluster's published listeners this host has
	// no fast-path route for (its route map is full; each container gets
	// an equal share): connections to them take the overlay.
	RoutesOver int `json:"routesOver,omitempty"`
	// Publish is how this host's listeners reached the cluster store.
	Publish *SocketsPublish `json:"publish,omitempty"`
}

// SocketsPublish counts the writes of this host's replaced listeners to
// the cluster store: changes are gathered and written at most once a
// publish interval, so a container that opens and closes listeners in a
// loop costs the store and the other agents one write per interval.
type SocketsPublish struct {
	Listeners int       `json:"listeners"` // in the store as last written
	Writes    uint64    `json:"writes"`    // writes of a changed set
	Last      time.Time `json:"last,omitzero"`
	Error     string    `json:"error,omitempty"` // of the last write, if it failed
}

// SocketsPolicy is the policy the sockets layer judges new fast-path
// connections by, at connect.
type SocketsPolicy struct {
	Rules    int  `json:"rules"`    // rules that can match TCP
	Overflow bool `json:"overflow"` // more than the layer takes: every connection takes the overlay
}

// SocketsContainer is one container's use of host sockets, as its broker
// counts it.
type SocketsContainer struct {
	ContainerID string `json:"containerID"`
	IP          string `json:"ip"`
	Broker      bool   `json:"broker"`    // its broker runs
	Ports       int    `json:"ports"`     // ports its host sockets hold (bound or listening), against the quota
	HandedOut   uint64 `json:"handedOut"` // host sockets given to its processes
	Replaced    uint64 `json:"replaced"`  // connections and listeners on host sockets
	Fallback    uint64 `json:"fallback"`  // sockets that fell back to the overlay
	// Privileged is a process of the container that holds CAP_NET_ADMIN or
	// CAP_SYS_ADMIN in the host's user namespace: its broker refuses the
	// container host sockets (secure mode). 0 if none.
	Privileged int `json:"privileged,omitempty"`
	// Seccomp is what its broker did with the connect() and listen()
	// calls of processes under skiff's seccomp profile (no preload).
	Seccomp SocketsSeccomp `json:"seccomp"`
}

// SocketsSeccomp counts a container's calls its broker served through the
// seccomp agent.
type SocketsSeccomp struct {
	Listeners  uint64  `json:"listeners"`  // notification listeners served now
	Replaced   uint64  `json:"replaced"`   // connections and listeners moved to host sockets
	Fallback   uint64  `json:"fallback"`   // in the cluster, left on the container's socket
	Passed     uint64  `json:"passed"`     // not for the fast path: continued untouched
	Dropped    uint64  `json:"dropped"`    // the caller went while handled
	MeanMicros float64 `json:"meanMicros"` // mean time to answer one
}

// CacheView is the cache layer's state: counters and every entry.
type CacheView struct {
	Stats   map[string]uint64 `json:"stats"`
	Entries CacheEntries      `json:"entries"`
}

// Error is an agent error as it travels over the API.
type Error struct {
	Message string `json:"error"`
	// Retry is set when the failure is temporary (store unreachable, agent
	// not ready): the caller should try again later.
	Retry  bool `json:"retry,omitempty"`
	Status int  `json:"-"`
}

func (e *Error) Error() string { return e.Message }

// ErrAgentUnreachable means nothing answered on the socket.
var ErrAgentUnreachable = errors.New("skiffd is not reachable")

// Client talks to one agent.
type Client struct {
	Socket string
	http   *http.Client
}

// NewClient returns a client for the agent listening on socket.
func NewClient(socket string) *Client {
	if socket == "" {
		socket = DefaultSocket
	}
	return &Client{Socket: socket, http: &http.Client{
		Timeout: 60 * time.Second,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		}},
	}}
}

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://skiffd"+path, body)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("%w at %s: %w", ErrAgentUnreachable, c.Socket, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("read answer of skiffd: %w", err)
	}
	if resp.StatusCode >= 300 {
		e := &Error{Status: resp.StatusCode}
		if json.Unmarshal(data, e) != nil || e.Message == "" {
			e.Message = fmt.Sprintf("skiffd answered %s: %s", resp.Status, bytes.TrimSpace(data))
		}
		return e
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("decode answer of skiffd to %s %s: %w", method, path, err)
	}
	return nil
}

// Status returns the agent's status.
func (c *Client) Status(ctx context.Context) (Status, error) {
	var s Status
	return s, c.do(ctx, http.MethodGet, "/v1/status", nil, &s)
}

// AddEndpoint attaches a container.
func (c *Client) AddEndpoint(ctx context.Context, r AddRequest) (Attachment, error) {
	var a Attachment
	return a, c.do(ctx, http.MethodPost, "/v1/endpoints", r, &a)
}

// CheckEndpoint verifies that a container's attachment is intact.
func (c *Client) CheckEndpoint(ctx context.Context, r AddRequest) (Attachment, error) {
	var a Attachment
	return a, c.do(ctx, http.MethodPost, "/v1/endpoints/check", r, &a)
}

// DeleteEndpoint detaches a container; detaching one that is gone succeeds.
func (c *Client) DeleteEndpoint(ctx context.Context, r AddRequest) error {
	return c.do(ctx, http.MethodPost, "/v1/endpoints/delete", r, nil)
}

// Endpoints lists endpoints of this host, or of every host when all is set.
func (c *Client) Endpoints(ctx context.Context, all bool) ([]EndpointStatus, error) {
	var eps []EndpointStatus
	q := "/v1/endpoints"
	if all {
		q += "?all=1"
	}
	return eps, c.do(ctx, http.MethodGet, q, nil, &eps)
}

// Hosts lists the cluster's hosts.
func (c *Client) Hosts(ctx context.Context) ([]cluster.Host, error) {
	var hs []cluster.Host
	return hs, c.do(ctx, http.MethodGet, "/v1/hosts", nil, &hs)
}

// Cache returns the cache layer's counters and entries.
func (c *Client) Cache(ctx context.Context) (CacheView, error) {
	var v CacheView
	return v, c.do(ctx, http.MethodGet, "/v1/cache", nil, &v)
}

// Policies lists the policy rules in evaluation order.
func (c *Client) Policies(ctx context.Context) (policy.Set, error) {
	var s policy.Set
	return s, c.do(ctx, http.MethodGet, "/v1/policies", nil, &s)
}

// CacheEntries is a snapshot of the cache layer's maps, for skiff cache.
type CacheEntries struct {
	EgressIPs   []EgressIP   `json:"egressIPs"`
	EgressHosts []EgressHost `json:"egressHosts"`
	Ingress     []Ingress    `json:"ingress"`
	Flows       []Flow       `json:"flows"`
}

// EgressIP maps a remote container to its host.
type EgressIP struct {
	Container netip.Addr `json:"container"`
	Host      netip.Addr `json:"host"`
}

// EgressHost is the cached encapsulation towards one host.
type EgressHost struct {
	Host      netip.Addr `json:"host"`
	Ifindex   uint32     `json:"ifindex"`
	OuterSrc  string     `json:"outerSrcMAC"`
	OuterDst  string     `json:"outerDstMAC"`
	InnerSrc  string     `json:"innerSrcMAC"`
	InnerDst  string     `json:"innerDstMAC"`
	VNI       uint32     `json:"vni"`
	UDPDstPrt uint16     `json:"udpDstPort"`
}

// Ingress is how a local container is reached.
type Ingress struct {
	Container netip.Addr `json:"container"`
	Ifindex   uint32     `json:"vethIfindex"`
	MACDst    string     `json:"macDst"`
	MACSrc    string     `json:"macSrc"`
	Ready     bool       `json:"ready"`
}

// Flow is one cached flow and the directions the overlay let through.
type Flow struct {
	Local   string `json:"local"`
	Remote  string `json:"remote"`
	Proto   string `json:"proto"`
	Egress  bool   `json:"egress"`
	Ingress bool   `json:"ingress"`
}
