// Package store is skiff's cluster store: hosts, endpoints, address leases and
// policies in etcd (v3 API). Every key lives under /skiff/v1/. Writes that must
// not race (subnet and address leases) are etcd transactions; agents learn
// about changes by watching prefixes.
package store

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/source"
)

// Key prefixes. Every key a host writes names the host right after its
// kind's prefix (see owner.go): etcd grants a host's role those ranges, and
// RemoveHost deletes them together.
const (
	Prefix         = "/skiff/v1/"
	configKey      = Prefix + "config"
	HostsPrefix    = Prefix + "hosts/"
	SubnetsPrefix  = Prefix + "subnets/"
	AddrsPrefix    = Prefix + "addrs/"
	EndpointPrefix = Prefix + "endpoints/"
	PolicyPrefix   = Prefix + "policies/"
	ListenerPrefix = Prefix + "listeners/"
	LimitPrefix    = Prefix + "limits/"
)

// ErrUnavailable wraps every failure to reach etcd, so callers (the agent API,
// the CNI plugin) can tell "try again later" from "you asked for nonsense".
var ErrUnavailable = source.ErrUnavailable

// ErrNotFound is returned for a key that does not exist.
var ErrNotFound = source.ErrNotFound

// ErrPermission wraps the store's refusal of a request this client's
// certificate (its etcd user) has no right to.
var ErrPermission = source.ErrPermission

// EndpointKey is where an endpoint is stored.
func EndpointKey(host, containerID, ifName string) string {
	return EndpointPrefix + host + "/" + containerID + "/" + ifName
}

// KeyOf is where e is stored.
func KeyOf(e cluster.Endpoint) string { return EndpointKey(e.Host, e.ContainerID, e.IfName) }

// HostKey is where a host is stored.
func HostKey(name string) string { return HostsPrefix + name }

func subnetName(p netip.Prefix) string { return strings.ReplaceAll(p.String(), "/", "-") }

// ClaimKey is host's claim on a host subnet; the subnet is in the key, so
// a claim cannot be moved to another subnet and keep its age. Of several
// claims on one subnet the oldest holds (see Claims).
func ClaimKey(host string, p netip.Prefix) string {
	return SubnetsPrefix + host + "/" + subnetName(p)
}

// AddrKey is the lease of one container address in host's subnet; its value
// is the endpoint key.
func AddrKey(host string, subnet netip.Prefix, a netip.Addr) string {
	return AddrSubnetPrefix(host, subnet) + a.String()
}

// LastAddrKey remembers the last address handed out in host's subnet, so
// that allocation walks round the subnet instead of reusing a just-released
// address.
func LastAddrKey(host string, subnet netip.Prefix) string {
	return AddrsPrefix + host + "/last/" + subnetName(subnet)
}

// AddrSubnetPrefix is the prefix of every address lease in host's subnet.
func AddrSubnetPrefix(host string, subnet netip.Prefix) string {
	return AddrsPrefix + host + "/" + subnetName(subnet) + "/"
}

// Store is a connection to the cluster store.
type Store struct {
	Client  *clientv3.Client
	timeout time.Duration
	tls     TLS
	tlsCfg  *tls.Config
	dial    Dialer
}

// Open connects to etcd over TLS as t says. Files that are missing, do not
// belong together, have expired, or that a reachable etcd refuses are an
// error naming the file. Open does not wait for the cluster otherwise: an
// unreachable store shows up as ErrUnavailable on the first call.
func Open(endpoints []string, t TLS) (*Store, error) { return OpenVia(endpoints, t, nil) }

// Dialer makes a store client's TCP connections to addr (HOST:PORT), for
// instance inside another network namespace.
type Dialer func(ctx context.Context, addr string) (net.Conn, error)

// OpenVia is Open with the connections dial makes (nil: the default).
func OpenVia(endpoints []string, t TLS, dial Dialer) (*Store, error) {
	if len(endpoints) == 0 {
		return nil, errors.New("no etcd endpoints given")
	}
	if err := t.checkSchemes(endpoints); err != nil {
		return nil, err
	}
	cfg, err := t.config()
	if err != nil {
		return nil, err
	}
	if cfg != nil {
		if err := t.probe(context.Background(), endpoints, cfg, dial); err != nil {
			return nil, err
		}
	}
	var opts []grpc.DialOption
	if dial != nil {
		opts = append(opts, grpc.WithContextDialer(dial))
	}
	if t.serverName != "" {
		opts = append(opts, grpc.WithAuthority(t.serverName))
	}
	cli, err := clientv3.New(clientv3.Config{
		DialOptions:          opts,
		Endpoints:            endpoints,
		TLS:                  cfg,
		DialTimeout:          2 * time.Second,
		DialKeepAliveTime:    5 * time.Second,
		DialKeepAliveTimeout: 2 * time.Second,
		Logger:               zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("etcd client for %v: %w", endpoints, err)
	}
	return &Store{Client: cli, timeout: 3 * time.Second, tls: t, tlsCfg: cfg, dial: dial}, nil
}

// TLS is how the store was opened.
func (s *Store) TLS() TLS { return s.tls }

// Close releases the connection.
func (s *Store) Close() error { return s.Client.Close() }

// Ping checks that the store answers. When it does not, a TLS handshake
// with each endpoint tells a refused or expired certificate from a store
// that is down.
func (s *Store) Ping(ctx context.Context) error {
	_, err := s.get(ctx, configKey)
	if err != nil && s.tlsCfg != nil {
		if perr := s.tls.probe(ctx, s.Client.Endpoints(), s.tlsCfg, s.dial); perr != nil {
			return fmt.Errorf("%w: %w", ErrUnavailable, perr)
		}
	}
	return err
}

func (s *Store) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.timeout)
}

// unavailable wraps a failed etcd call: as ErrUnavailable, unless etcd
// answered that the request itself is wrong (too many operations, too
// large) or not this client's to make (ErrPermission), which waiting for
// the store would not mend.
func unavailable(op string, err error) error {
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		switch ee.Code() {
		case codes.InvalidArgument:
			return fmt.Errorf("%s: %w", op, err)
		case codes.PermissionDenied:
			return fmt.Errorf("%s: %w: %w", op, ErrPermission, err)
		}
	}
	return fmt.Errorf("%s: %w: %w", op, ErrUnavailable, err)
}

func (s *Store) get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	resp, err := s.Client.Get(ctx, key, opts...)
	if err != nil {
		return nil, unavailable("read "+key, err)
	}
	return resp, nil
}

// Txn runs a transaction with the store's timeout; failures to reach etcd are
// ErrUnavailable.
func (s *Store) Txn(ctx context.Context, cmps []clientv3.Cmp, then []clientv3.Op, els ...clientv3.Op) (*clientv3.TxnResponse, error) {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	resp, err := s.Client.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
	if err != nil {
		return nil, unavailable("transaction", err)
	}
	return resp, nil
}

// EnsureCluster stores want as the cluster configuration unless one exists,
// and returns the configuration in force. Agents started with a different
// configuration get an error rather than a split cluster.
func (s *Store) EnsureCluster(ctx context.Context, want cluster.Config) (cluster.Config, error) {
	if err := want.Validate(); err != nil {
		return cluster.Config{}, err
	}
	val, _ := json.Marshal(want)
	resp, err := s.Txn(ctx,
		[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(configKey), "=", 0)},
		[]clientv3.Op{clientv3.OpPut(configKey, string(val))},
		clientv3.OpGet(configKey))
	if err != nil {
		return cluster.Config{}, err
	}
	if resp.Succeeded {
		return want, nil
	}
	var have cluster.Config
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) != 1 {
		return cluster.Config{}, errors.New("cluster config vanished during read")
	}
	if err := json.Unmarshal(kvs[0].Value, &have); err != nil {
		return cluster.Config{}, fmt.Errorf("decode cluster config: %w", err)
	}
	if have != want {
		return have, fmt.Errorf("cluster already configured as %+v, this agent asks for %+v", have, want)
	}
	return have, nil
}

func (s *Store) getJSON(ctx context.Context, key string, v any) error {
	resp, err := s.get(ctx, key)
	if err != nil {
		return err
	}
	if len(resp.Kvs) == 0 {
		return fmt.Errorf("%s: %w", key, ErrNotFound)
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, v); err != nil {
		return fmt.Errorf("decode %s: %w", key, err)
	}
	return nil
}

func list[T any](ctx context.Context, s *Store, prefix string) ([]T, error) {
	resp, err := s.get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	return decodeAll[T](resp.Kvs)
}

// decodeAll decodes values, leaving out those not believed (see decode).
func decodeAll[T any](kvs []*mvccpb.KeyValue) ([]T, error) {
	out := make([]T, 0, len(kvs))
	for _, kv := range kvs {
		v, ok, err := decode[T](kv.Key, kv.Value)
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, v)
		}
	}
	return out, nil
}

// decode decodes the value at key. A record not at its own key (see keyOf)
// is not believed (ok false), nor is one that does not decode at a key a
// host owns: a host can write what it likes into its own keys, and one
// garbled record must not stop every agent's reads (its own agent repairs
// its record). A value of the administrator's (a policy) that does not
// decode is an error: half a policy is not applied.
func decode[T any](key, val []byte) (v T, ok bool, err error) {
	if err := json.Unmarshal(val, &v); err != nil {
		if OwnerOf(string(key)) != "" {
			return v, false, nil
		}
		return v, false, fmt.Errorf("decode %s: %w", key, err)
	}
	return v, keyOf(v) == string(key), nil
}

// Host returns one host.
func (s *Store) Host(ctx context.Context, name string) (cluster.Host, error) {
	var h cluster.Host
	return h, s.getJSON(ctx, HostKey(name), &h)
}

// Hosts lists every host that holds the subnet its record names (see
// Holders) and whose underlay address can be believed (see Underlays): a
// record naming a subnet another host claimed first is left out, as is
// one written for another host's name, one with an unusable underlay
// address and one with an address a host with an older claim publishes.
func (s *Store) Hosts(ctx context.Context) ([]cluster.Host, error) {
	resp, err := s.Txn(ctx, nil, []clientv3.Op{
		clientv3.OpGet(HostsPrefix, clientv3.WithPrefix()),
		clientv3.OpGet(SubnetsPrefix, clientv3.WithPrefix(), clientv3.WithKeysOnly()),
		clientv3.OpGet(configKey),
	})
	if err != nil {
		return nil, err
	}
	hosts, err := decodeAll[cluster.Host](resp.Responses[0].GetResponseRange().Kvs)
	if err != nil {
		return nil, err
	}
	holders := Holders(claimsOf(resp.Responses[1].GetResponseRange().Kvs))
	hosts = slices.DeleteFunc(hosts, func(h cluster.Host) bool { return holders[h.Subnet].Host != h.Name })
	var cfg cluster.Config // none yet: no cluster range to judge against
	if kvs := resp.Responses[2].GetResponseRange().Kvs; len(kvs) == 1 {
		_ = json.Unmarshal(kvs[0].Value, &cfg) // a garbled one: likewise
	}
	return Underlays(hosts, holders, cfg.CIDR), nil
}

// RemoveHost deletes a host with everything it owns (HostRanges): its
// record, subnet claims, address leases, endpoints and listeners. Other
// agents see the host key go and remove their routes to it. It takes the
// administrator's credential.
func (s *Store) RemoveHost(ctx context.Context, name string) error {
	if err := ValidateHostName(name); err != nil {
		return err
	}
	var ops []clientv3.Op
	for _, r := range HostRanges(name) {
		ops = append(ops, clientv3.OpDelete(r.Key, clientv3.WithRange(r.End)))
	}
	resp, err := s.Txn(ctx, nil, ops)
	if err != nil {
		return err
	}
	for _, r := range resp.Responses {
		if r.GetResponseDeleteRange().Deleted > 0 {
			return nil
		}
	}
	return fmt.Errorf("host %s: %w", name, ErrNotFound)
}

// Endpoints lists the endpoints of one host, or of all hosts when host is "".
func (s *Store) Endpoints(ctx context.Context, host string) ([]cluster.Endpoint, error) {
	p := EndpointPrefix
	if host != "" {
		p += host + "/"
	}
	return list[cluster.Endpoint](ctx, s, p)
}

// Endpoint returns one endpoint.
func (s *Store) Endpoint(ctx context.Context, host, containerID, ifName string) (cluster.Endpoint, error) {
	var e cluster.Endpoint
	return e, s.getJSON(ctx, EndpointKey(host, containerID, ifName), &e)
}

// PutEndpoint overwrites an existing endpoint record (e.g. to add its MAC).
func (s *Store) PutEndpoint(ctx context.Context, e cluster.Endpoint) error {
	val, _ := json.Marshal(e)
	resp, err := s.Txn(ctx,
		[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(KeyOf(e)), ">", 0)},
		[]clientv3.Op{clientv3.OpPut(KeyOf(e), string(val))})
	if err != nil {
		return err
	}
	if !resp.Succeeded {
		return fmt.Errorf("endpoint %s: %w", KeyOf(e), ErrNotFound)
	}
	return nil
}

// Listeners lists every host's replaced listeners.
func (s *Store) Listeners(ctx context.Context) ([]cluster.Listener, error) {
	return list[cluster.Listener](ctx, s, ListenerPrefix)
}

func listenerKey(l cluster.Listener) string { return ListenerPrefix + l.Host + "/" + l.Addr.String() }

// SetListeners makes host's published listeners exactly ls. Only changes
// are written, so an unchanged set wakes no watcher.
func (s *Store) SetListeners(ctx context.Context, host string, ls []cluster.Listener) error {
	resp, err := s.get(ctx, ListenerPrefix+host+"/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return err
	}
	have := map[string]bool{}
	for _, kv := range resp.Kvs {
		have[string(kv.Key)] = true
	}
	var ops []clientv3.Op
	for _, l := range ls {
		if l.Host != host {
			return fmt.Errorf("listener %s belongs to %s, not %s", l.Addr, l.Host, host)
		}
		k := listenerKey(l)
		if have[k] {
			delete(have, k)
			continue
		}
		val, _ := json.Marshal(l)
		ops = append(ops, clientv3.OpPut(k, string(val)))
	}
	for k := range have {
		ops = append(ops, clientv3.OpDelete(k))
	}
	// etcd takes at most 128 operations in one transaction (its default
	// --max-txn-ops): a host that publishes more at once (an agent's start,
	// the store back after an outage) writes them in steps, which watchers
	// may see one at a time.
	for len(ops) > 0 {
		n := min(len(ops), maxTxnOps)
		if _, err := s.Txn(ctx, nil, ops[:n]); err != nil {
			return err
		}
		ops = ops[n:]
	}
	return nil
}

// maxTxnOps is etcd's default limit on the operations of one transaction.
const maxTxnOps = 128

// Policies returns the policy rules in evaluation order.
func (s *Store) Policies(ctx context.Context) (policy.Set, error) {
	rules, err := list[policy.Rule](ctx, s, PolicyPrefix)
	if err != nil {
		return nil, err
	}
	return policy.NewSet(rules)
}

// PutPolicy adds or replaces a rule.
func (s *Store) PutPolicy(ctx context.Context, r policy.Rule) error {
	if err := r.Validate(); err != nil {
		return err
	}
	val, _ := json.Marshal(r)
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	if _, err := s.Client.Put(ctx, PolicyPrefix+r.ID, string(val)); err != nil {
		return unavailable("write policy", err)
	}
	return nil
}

// DeletePolicy removes a rule; a missing rule is ErrNotFound.
func (s *Store) DeletePolicy(ctx context.Context, id string) error {
	ctx, cancel := s.ctx(ctx)
	defer cancel()
	resp, err := s.Client.Delete(ctx, PolicyPrefix+id)
	if err != nil {
		return unavailable("delete policy", err)
	}
	if resp.Deleted == 0 {
		return fmt.Errorf("policy %s: %w", id, ErrNotFound)
	}
	return nil
}

// Watch sends on the returned channel whenever a key under one of the
// prefixes changes, coalescing bursts. The channel closes when ctx ends or the
// watch breaks (store unreachable, compaction); callers re-list and re-watch.
func (s *Store) Watch(ctx context.Context, prefixes ...string) <-chan struct{} {
	out := make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	merged := make(chan clientv3.WatchResponse)
	for _, p := range prefixes {
		wc := s.Client.Watch(ctx, p, clientv3.WithPrefix())
		go func() {
			defer cancel() // one broken watch ends all, so the caller re-lists
			for resp := range wc {
				select {
				case merged <- resp:
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	go func() {
		defer close(out)
		for {
			select {
			case <-ctx.Done():
				return
			case resp := <-merged:
				if resp.Err() != nil || resp.Canceled {
					cancel()
					return
				}
				select {
				case out <- struct{}{}:
				default: // a signal is already pending
				}
			}
		}
	}()
	return out
}
