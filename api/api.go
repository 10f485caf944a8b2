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
	"net/url"
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
	// Pod is the Kubernetes pod the kubelet names (CNI_ARGS K8S_POD_*).
	Pod *cluster.Pod `json:"pod,omitempty"`
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
	// Layers is every layer skiffd knows: on, with what it reports, or
	// off and why.
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
	// SourceDrops counts, by reason, the packets containers sent that the
	// source check on their veths dropped (every mode).
	SourceDrops map[string]uint64 `json:"sourceDrops,omitempty"`
	// PolicyDenies counts, by rule id, the packets this host's policy
	// denied (new flows, broadcast copies) since the agent started or the
	// rules last changed.
	PolicyDenies map[string]uint64 `json:"policyDenies,omitempty"`
	// QoS counts the underlay packets of QoS-classed containers marked
	// (marked) and the overlay packets of normal ones (unclassed).
	QoS map[string]uint64 `json:"qos,omitempty"`
	// Maps is the use of every pinned eBPF map of this host whose entries
	// come and go (docs/maps.md), read at most every 10 s.
	Maps []MapUse `json:"maps,omitempty"`
}

// MapUse is how full one eBPF map is.
type MapUse struct {
	Name     string `json:"name"` // its pin below the agent's directory (cache/skc_flows)
	Type     string `json:"type"` // Hash, LRUHash, LPMTrie, SockHash, ...
	Entries  int    `json:"entries"`
	Capacity int    `json:"capacity"`
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

// Layer is one data-plane layer of a host (docs/layers.md): in a status,
// with what the running layer reports.
type Layer struct {
	Name   string `json:"name"`
	On     bool   `json:"on"`
	Reason string `json:"reason,omitempty"` // why it is off
	// Counters are its programs' event counters by name.
	Counters map[string]uint64 `json:"counters,omitempty"`
	// Details is the layer's own status (a type of its package).
	Details json.RawMessage `json:"details,omitempty"`
	// View is how skiff status shows it.
	View []Section `json:"view,omitempty"`
}

// Section is part of a layer's view: a title, lines, and a table (Header
// and Rows) when it has one.
type Section struct {
	Title  string     `json:"title,omitempty"`
	Lines  []string   `json:"lines,omitempty"`
	Header []string   `json:"header,omitempty"`
	Rows   [][]string `json:"rows,omitempty"`
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

// Layer returns what a running layer reports at length (skiff layer
// NAME): its status, and what else it shows (the cache: its entries).
func (c *Client) Layer(ctx context.Context, name string) (Layer, error) {
	var l Layer
	return l, c.do(ctx, http.MethodGet, "/v1/layers/"+url.PathEscape(name), nil, &l)
}

// Policies lists the policy rules in evaluation order.
func (c *Client) Policies(ctx context.Context) (policy.Set, error) {
	var s policy.Set
	return s, c.do(ctx, http.MethodGet, "/v1/policies", nil, &s)
}
