package lab

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/store"
)

// TestStoreDamage: the store loses or garbles a host's record, its subnet
// lease or both (an operator's slip, a bad restore): the host's agent
// writes them again with its subnet within 30 s, its containers stay
// reachable, and then it leaves the store and its log alone. (Before, a
// deleted record made the agent lease a second subnet and loop at about
// 400 store writes and log lines a second.)
func TestStoreDamage(t *testing.T) {
	l := newLab(t, Config{Name: "tdamage", Hosts: 2, ContainersPerHost: 1})
	ctx := context.Background()
	admin := storeAdmin(t, l, "h1")
	st, err := agentOf(t, l, "h2").Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	subnet := st.Host.Subnet
	for _, c := range []string{"h1/c1", "h2/c1"} {
		echoServer(t, l, c, echoPort)
	}
	h2Log := filepath.Join(l.hostDir("h2"), "skiffd.log")
	t.Logf("store writes in 10 s before any damage: %d", writesIn(t, admin, 10*time.Second))

	hostKey, leaseKey := store.HostKey("h2"), store.SubnetKey(subnet)
	del := func(keys ...string) func() error {
		return func() error {
			for _, k := range keys {
				if _, err := admin.Delete(ctx, k); err != nil {
					return err
				}
			}
			return nil
		}
	}
	put := func(key, val string) func() error {
		return func() error { _, err := admin.Put(ctx, key, val); return err }
	}
	for _, tc := range []struct {
		name   string
		damage func() error
	}{
		{"host record deleted", del(hostKey)},
		{"subnet lease deleted", del(leaseKey)},
		{"record and lease deleted", del(hostKey, leaseKey)},
		{"garbage in the record", put(hostKey, `{"name": "h2", "subn`)},
		{"garbage in the lease", put(leaseKey, `{"name": `)},
	} {
		lines := lineCount(h2Log)
		if err := tc.damage(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		took, err := eventually(30*time.Second, func() error { return registered(ctx, t, l, admin, "h2", subnet) })
		if err != nil {
			t.Errorf("%s: not repaired within 30 s: %v", tc.name, err)
		} else {
			t.Logf("%s: repaired in %v", tc.name, took.Round(time.Millisecond))
		}
		for _, p := range [][2]string{{"h1/c1", "h2/c1"}, {"h2/c1", "h1/c1"}} {
			dst, _ := l.IP(p[1])
			if err := exchange(l, p[0], "tcp4", netip.AddrPortFrom(dst, echoPort)); err != nil {
				t.Errorf("%s: tcp %s -> %s: %v", tc.name, p[0], p[1], err)
			}
			if err := ping(ctx, l, p[0], dst); err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
		}
		// Back to idle: no writes (the resync every 30 s writes nothing
		// either); a loose bound that a write loop still breaks.
		writes := writesIn(t, admin, 10*time.Second)
		if writes > 3 {
			t.Errorf("%s: %d store writes in 10 s after the repair, want none", tc.name, writes)
		}
		logged := lineCount(h2Log) - lines
		if logged > 20 {
			t.Errorf("%s: h2 logged %d lines since the damage, want a few", tc.name, logged)
		}
		t.Logf("%s: then %d store writes in 10 s; h2 logged %d lines", tc.name, writes, logged)
	}

	// h2's record and lease gone, and another host registered with its
	// subnet in the meantime: h2 says so, is not ready, and writes nothing.
	h3, _ := json.Marshal(cluster.Host{Name: "h3", UnderlayIP: netip.MustParseAddr("10.99.0.77"), Subnet: subnet, VTEPMAC: "0e:00:00:00:00:77"})
	lines := lineCount(h2Log)
	if _, err := admin.Txn(ctx).Then(clientv3.OpDelete(hostKey), clientv3.OpPut(leaseKey, "h3"),
		clientv3.OpPut(store.HostKey("h3"), string(h3))).Commit(); err != nil {
		t.Fatal(err)
	}
	var st2 api.Status
	if _, err := eventually(10*time.Second, func() (err error) {
		if st2, err = agentOf(t, l, "h2").Status(ctx); err == nil && (st2.Ready || !strings.Contains(st2.SyncError, "h3")) {
			err = errors.New("h2 still ready, or not naming h3")
		}
		return err
	}); err != nil {
		t.Fatalf("subnet given to h3: %v; %+v", err, st2)
	}
	t.Logf("subnet given to h3: h2 says %q", st2.SyncError)
	if !strings.Contains(st2.SyncError, "restart skiffd") {
		t.Errorf("h2's error does not say what to do: %q", st2.SyncError)
	}
	if writes := writesIn(t, admin, 10*time.Second); writes > 0 {
		t.Errorf("subnet given to h3: %d store writes in 10 s, want none", writes)
	}
	if logged := lineCount(h2Log) - lines; logged > 20 {
		t.Errorf("subnet given to h3: h2 logged %d lines, want a few", logged)
	}
}

// TestReadyFollowsStore: with the store down, the agent and CNI STATUS say
// not ready within seconds; once it is back, the agent resyncs at once and
// is ready again.
func TestReadyFollowsStore(t *testing.T) {
	l := newLab(t, Config{Name: "tready", Hosts: 1})
	ctx := context.Background()
	cniStatus := func() error {
		c, list, err := l.cni("h1")
		if err != nil {
			t.Fatal(err)
		}
		return c.GetStatusNetworkList(ctx, list)
	}
	if err := cniStatus(); err != nil {
		t.Fatalf("CNI STATUS with the store up: %v", err)
	}
	h1 := agentOf(t, l, "h1")
	ready := func(want bool) func() error {
		return func() error {
			st, err := h1.Status(ctx)
			if err != nil || st.Ready != want {
				return fmt.Errorf("ready %v (%v), want %v; %+v", st.Ready, err, want, st)
			}
			return nil
		}
	}
	if err := l.StopEtcd(ctx); err != nil {
		t.Fatal(err)
	}
	took, err := eventually(15*time.Second, ready(false))
	if err != nil || took > 6*time.Second {
		t.Fatalf("store down: not ready after %v: %v", took, err)
	}
	t.Logf("not ready %v after the store stopped", took.Round(time.Millisecond))
	if err := cniStatus(); err == nil {
		t.Error("CNI STATUS with the store down succeeded")
	}
	time.Sleep(3 * time.Second) // past gRPC's first reconnect attempts
	if err := l.StartEtcd(); err != nil {
		t.Fatal(err)
	}
	took, err = eventually(15*time.Second, ready(true))
	if err != nil || took > 8*time.Second {
		t.Fatalf("store back: ready after %v: %v", took, err)
	}
	t.Logf("ready %v after the store started again", took.Round(time.Millisecond))
	if err := cniStatus(); err != nil {
		t.Errorf("CNI STATUS with the store back: %v", err)
	}
}

// registered checks that host's record and lease name subnet, that its
// agent is ready with it, and that another host routes to it.
func registered(ctx context.Context, t *testing.T, l *Lab, admin *clientv3.Client, host string, subnet netip.Prefix) error {
	resp, err := admin.Txn(ctx).Then(clientv3.OpGet(store.HostKey(host)), clientv3.OpGet(store.SubnetKey(subnet))).Commit()
	if err != nil {
		return err
	}
	var h cluster.Host
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) != 1 || json.Unmarshal(kvs[0].Value, &h) != nil || h.Subnet != subnet {
		return fmt.Errorf("record of %s: %v, want subnet %s", host, kvs, subnet)
	}
	if kvs := resp.Responses[1].GetResponseRange().Kvs; len(kvs) != 1 || string(kvs[0].Value) != host {
		return fmt.Errorf("lease of %s: %v, want %s", subnet, kvs, host)
	}
	for _, h := range l.Hosts {
		st, err := agentOf(t, l, h.Name).Status(ctx)
		if err != nil || !st.Ready {
			return fmt.Errorf("%s not ready: %v %s", h.Name, err, st.SyncError)
		}
		if h.Name == host && st.Host.Subnet != subnet {
			return fmt.Errorf("%s serves %s, want %s", host, st.Host.Subnet, subnet)
		}
		if ok, err := routeTo(l, h.Name, subnet); h.Name != host && (!ok || err != nil) {
			return fmt.Errorf("%s has no route to %s (%v)", h.Name, subnet, err)
		}
	}
	return nil
}

// storeAdmin is a client of the lab's store with the administrator's
// certificate. It connects from inside host: the store is on the lab's
// underlay, which the test's own namespace does not reach.
func storeAdmin(t *testing.T, l *Lab, host string) *clientv3.Client {
	t.Helper()
	creds, err := l.EtcdTLS(store.AdminName)
	if err != nil {
		t.Fatal(err)
	}
	var cfg *tls.Config
	if !creds.Insecure {
		cert, err := tls.LoadX509KeyPair(creds.CertFile, creds.KeyFile)
		if err != nil {
			t.Fatal(err)
		}
		ca, err := os.ReadFile(creds.CAFile)
		if err != nil {
			t.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(ca)
		cfg = &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	dial := func(ctx context.Context, addr string) (c net.Conn, err error) {
		err = l.Do(host, func() error {
			c, err = (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			return err
		})
		return c, err
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: l.EtcdEndpoints(), TLS: cfg, DialTimeout: 5 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithContextDialer(dial)}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// writesIn counts the store's writes (revisions) during d.
func writesIn(t *testing.T, cli *clientv3.Client, d time.Duration) int64 {
	t.Helper()
	revision := func() int64 {
		resp, err := cli.Get(context.Background(), store.Prefix+"config")
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	start := revision()
	time.Sleep(d)
	return revision() - start
}

func lineCount(file string) int {
	data, err := os.ReadFile(file)
	if errors.Is(err, os.ErrNotExist) {
		return 0
	}
	return bytes.Count(data, []byte("\n"))
}
