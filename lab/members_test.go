package lab

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/store"
)

// TestStoreMemberLoss: a 3-member store loses its leader while a stream
// runs between containers on two hosts and ADDs go on, on both hosts:
// every ADD succeeds (a runtime tries error 11 again; an RPC in flight to
// the killed member may fail), the stream flows, nothing is lost (every
// container has its own address, leased in the store). A second member lost leaves no
// majority: ADD answers CNI error 11 (try again later) saying why, while
// the data path keeps forwarding; with both members back, ADD works again
// and every agent is in sync. Containers are refused every member's client
// and peer ports.
func TestStoreMemberLoss(t *testing.T) {
	l := newLab(t, Config{Name: "tmember", Hosts: 2, ContainersPerHost: 1, EtcdMembers: 3})
	ctx := context.Background()
	var probes []string
	for _, m := range l.Etcd {
		probes = append(probes, netip.AddrPortFrom(m.IP, 2379).String(), netip.AddrPortFrom(m.IP, 2380).String())
	}
	out := strings.TrimSpace(runPy(t, l, "h1/c1", probeTCP, nil, probes...))
	if lines := strings.Split(out, "\n"); len(lines) != len(probes) || strings.Contains(out, " open") {
		t.Errorf("a container reaches the store's members:\n%s", out)
	}

	s := adminFrom(t, l, "h1")
	stream := startStream(t, l, "h1/c1", "h2/c1", 7300)

	// One member lost: the leader, so the others must elect a new one.
	// ADDs go on, alternating hosts, from before the kill until well after
	// the election.
	leader := leaderOf(t, l, s)
	stop, started := make(chan struct{}), make(chan struct{})
	type result struct {
		adds    int
		slowest time.Duration
		err     error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		defer func() { done <- r }()
		for ; ; r.adds++ {
			if r.adds == 2 {
				close(started)
			}
			select {
			case <-stop:
				return
			default:
			}
			begin := time.Now()
			actx, cancel := context.WithTimeout(ctx, 20*time.Second)
			_, r.err = l.AddContainer(actx, l.Hosts[r.adds%2].Name)
			cancel()
			if r.err != nil {
				return
			}
			r.slowest = max(r.slowest, time.Since(begin))
		}
	}()
	<-started
	if err := syscall.Kill(leader.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	t.Logf("killed the leader %s (pid %d)", leader.Name, leader.PID)
	time.Sleep(3 * time.Second)
	close(stop)
	r := <-done
	if r.err != nil {
		t.Fatalf("ADD with a member lost: %v", r.err)
	}
	t.Logf("%d ADDs, %d of them tried again (CNI error 11), the slowest took %v", r.adds, l.addRetries, r.slowest.Round(time.Millisecond))
	if err := stream.progresses(2 * time.Second); err != nil {
		t.Fatalf("stream with a member lost: %v", err)
	}
	nothingLost(t, l, s)
	newest := func(host string) Container {
		for i := len(l.Containers) - 1; ; i-- {
			if l.Containers[i].Host == host {
				return l.Containers[i]
			}
		}
	}
	if err := ping(ctx, l, "h1/c1", newest("h2").IP); err != nil {
		t.Fatal(err)
	}

	// Two lost: no majority.
	second := leaderOf(t, l, s)
	if err := syscall.Kill(second.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	t.Logf("killed %s (pid %d)", second.Name, second.PID)
	i := l.nextContainerIndex("h1")
	c := Container{Name: fmt.Sprintf("h1/c%d", i), Host: "h1", Netns: fmt.Sprintf("%sh1-c%d", l.prefix(), i)}
	c.ID = c.Netns
	if err := addNetns(c.Netns); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err := l.cniAddOnce(ctx, c)
	var ce *types.Error
	if !errors.As(err, &ce) || ce.Code != types.ErrTryAgainLater || !strings.Contains(ce.Details, "cluster store unavailable") {
		t.Errorf("ADD without a majority: %v, want CNI error %d saying the store is unavailable", err, types.ErrTryAgainLater)
	} else {
		t.Logf("ADD without a majority after %v: %v (%s)", time.Since(start).Round(time.Millisecond), err, ce.Details)
	}
	if err := l.killNetns(ctx, c.Netns); err != nil {
		t.Fatal(err)
	}
	if st, err := eventuallyStatus(agentOf(t, l, "h2"), func(s api.Status) bool { return !s.StoreReachable }); err != nil {
		t.Errorf("the agent does not report the store unreachable: %+v, %v", st, err)
	}
	if err := ping(ctx, l, newest("h1").Name, newest("h2").IP); err != nil {
		t.Errorf("forwarding without a majority: %v", err)
	}
	if err := stream.progresses(2 * time.Second); err != nil {
		t.Errorf("stream without a majority: %v", err)
	}

	// Both back.
	if err := l.StartEtcd(); err != nil {
		t.Fatal(err)
	}
	if err := l.WaitReady(ctx, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	name, err := l.AddContainer(ctx, "h2")
	if err != nil {
		t.Fatalf("ADD with the members back: %v", err)
	}
	ip, _ := l.IP(name)
	if err := ping(ctx, l, "h1/c1", ip); err != nil {
		t.Fatal(err)
	}
	for _, ep := range l.EtcdEndpoints() {
		if _, err := s.Status(ctx, ep); err != nil {
			t.Errorf("member %s after restart: %v", ep, err)
		}
	}
	nothingLost(t, l, s)
	if err := stream.finish(); err != nil {
		t.Errorf("stream: %v", err)
	}
}

// adminFrom is an etcd client with the administrator's certificate that
// reaches the store from host, as an operator's would: the store's
// addresses exist only in the lab.
func adminFrom(t *testing.T, l *Lab, host string) *clientv3.Client {
	t.Helper()
	admin, err := l.EtcdTLS(store.AdminName)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.LoadX509KeyPair(admin.CertFile, admin.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(admin.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	dial := func(ctx context.Context, addr string) (c net.Conn, err error) {
		err = l.Do(host, func() error {
			c, err = (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			return err
		})
		return c, err
	}
	c, err := clientv3.New(clientv3.Config{
		Endpoints: l.EtcdEndpoints(), DialTimeout: 2 * time.Second, Logger: zap.NewNop(),
		TLS:         &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}},
		DialOptions: []grpc.DialOption{grpc.WithContextDialer(dial)},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// leaderOf returns the member the running members follow.
func leaderOf(t *testing.T, l *Lab, s *clientv3.Client) Member {
	t.Helper()
	status := func(m Member) (*clientv3.StatusResponse, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		return s.Status(ctx, l.clientURL(m))
	}
	ids := map[uint64]Member{}
	var leader uint64
	for _, m := range l.Etcd {
		if st, err := status(m); err == nil {
			ids[st.Header.MemberId], leader = m, st.Leader
		}
	}
	if m, ok := ids[leader]; ok {
		return m
	}
	t.Fatalf("no leader among the running members %v", ids)
	return Member{}
}

// nothingLost checks that the store holds exactly the lab's containers,
// each with the address its ADD answered, no two alike.
func nothingLost(t *testing.T, l *Lab, s *clientv3.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := s.Get(ctx, store.EndpointPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	inStore := map[string]netip.Addr{}
	for _, kv := range resp.Kvs {
		var e cluster.Endpoint
		if err := json.Unmarshal(kv.Value, &e); err != nil {
			t.Fatalf("%s: %v", kv.Key, err)
		}
		inStore[e.ContainerID] = e.IP.Addr()
	}
	seen := map[netip.Addr]string{}
	for _, c := range l.Containers {
		if inStore[c.ID] != c.IP {
			t.Errorf("%s has %s, the store says %v", c.Name, c.IP, inStore[c.ID])
		}
		if other, dup := seen[c.IP]; dup {
			t.Errorf("%s and %s both have %s", c.Name, other, c.IP)
		}
		seen[c.IP] = c.Name
	}
	if len(inStore) != len(l.Containers) {
		t.Errorf("the store has %d endpoints, the lab %d containers", len(inStore), len(l.Containers))
	}
}
