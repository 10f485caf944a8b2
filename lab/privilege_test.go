package lab

import (
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/store"
)

// TestStorePrivileges: from h1's namespace with h1's certificate, h2's keys
// can be read but not written or deleted (record, endpoints, address
// leases, subnet claim), nor policies written; the administrator can;
// without a certificate the store answers nothing; an agent whose
// certificate has no user in the store stops at start with an error that
// says so.
func TestStorePrivileges(t *testing.T) {
	l := newLab(t, Config{Name: "tpriv", Hosts: 2, ContainersPerHost: 1})
	ctx := context.Background()
	h1, err := l.OpenStore("h1", "h1")
	if err != nil {
		t.Fatal(err)
	}
	defer h1.Close()
	h2, err := h1.Host(ctx, "h2")
	if err != nil {
		t.Fatalf("h1 reads h2's record: %v", err)
	}
	eps, err := h1.Endpoints(ctx, "h2")
	if err != nil || len(eps) != 1 {
		t.Fatalf("h1 reads h2's endpoints: %v, %v", eps, err)
	}
	forged := h2
	forged.UnderlayIP = l.Hosts[0].UnderlayIP
	val, _ := json.Marshal(forged)
	write := func(ops ...clientv3.Op) error { _, err := h1.Txn(ctx, nil, ops); return err }
	for what, err := range map[string]error{
		"put h2's record":       write(clientv3.OpPut(store.HostKey("h2"), string(val))),
		"delete h2's record":    write(clientv3.OpDelete(store.HostKey("h2"))),
		"put h2's endpoint":     write(clientv3.OpPut(store.KeyOf(eps[0]), "{}")),
		"delete h2's endpoint":  write(clientv3.OpDelete(store.KeyOf(eps[0]))),
		"delete h2's lease":     write(clientv3.OpDelete(store.AddrKey("h2", h2.Subnet, eps[0].IP.Addr()))),
		"delete h2's claim":     write(clientv3.OpDelete(store.ClaimKey("h2", h2.Subnet))),
		"delete every endpoint": write(clientv3.OpDelete(store.EndpointPrefix, clientv3.WithPrefix())),
		"put a policy":          h1.PutPolicy(ctx, policy.Rule{ID: "evil", Priority: 1, Action: policy.Deny}),
		"remove h2":             h1.RemoveHost(ctx, "h2"),
	} {
		if !errors.Is(err, store.ErrPermission) {
			t.Errorf("h1 may %s: %v", what, err)
		}
	}
	if err := errors.Join(write(clientv3.OpPut(store.EndpointKey("h1", "probe", "eth9"), "{}")), write(clientv3.OpDelete(store.EndpointKey("h1", "probe", "eth9")))); err != nil {
		t.Errorf("h1 writes its own keys: %v", err)
	}
	if got, err := h1.Host(ctx, "h2"); err != nil || !got.Equal(h2) {
		t.Errorf("h2's record after h1's attempts: %+v, %v", got, err)
	}
	if err := l.PutPolicy(ctx, policy.Rule{ID: "admin", Priority: 1, Action: policy.Allow}); err != nil {
		t.Errorf("the administrator writes a policy: %v", err)
	}
	if err := l.DeletePolicy(ctx, "admin"); err != nil {
		t.Errorf("the administrator deletes a policy: %v", err)
	}

	// Without a client certificate (and over plain HTTP) the store answers
	// nothing.
	ca, _ := l.EtcdTLS(store.AdminName)
	for _, args := range [][]string{
		{"--cacert", ca.CAFile, "https://10.99.0.254:2379/v3/kv/range"},
		{"http://10.99.0.254:2379/v3/kv/range"},
	} {
		cmd, _ := l.Command(ctx, "h1", "curl", append([]string{"-sS", "--max-time", "5", "-X", "POST", "-d", `{"key":"AA==","range_end":"AA=="}`}, args...)...)
		out, err := cmd.CombinedOutput()
		if err == nil || strings.Contains(string(out), "kvs") {
			t.Errorf("curl %v: %v, %s; want a refusal", args, err, out)
		}
	}

	// A certificate of the cluster's CA whose name has no user: skiffd
	// stops at start, saying so.
	nobody, err := l.EtcdTLS("h9")
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd, _ := l.Command(cctx, "h1", l.Config.BinDir+"/skiffd", "--name", "h9", "--underlay-interface", "eth0", "--etcd-endpoints", l.etcdURL(),
		"--etcd-cafile", nobody.CAFile, "--etcd-certfile", nobody.CertFile, "--etcd-keyfile", nobody.KeyFile,
		"--socket", t.TempDir()+"/s.sock", "--state-dir", t.TempDir())
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || cctx.Err() != nil || !strings.Contains(string(out), "no user and role for host h9") {
		t.Errorf("skiffd without a store user: %v, %s", err, out)
	}
	if hosts, err := h1.Hosts(ctx); err != nil || len(hosts) != 2 {
		t.Errorf("hosts %v, %v", hosts, err)
	}
}

// TestRecordChurnPaced: h1 rewriting its own record 1 000 times as fast as
// it can (its certificate allows it) makes h2 reconcile a bounded number
// of times, one per 100 ms at most plus a trailing one, not once per write.
func TestRecordChurnPaced(t *testing.T) {
	l := newLab(t, Config{Name: "tchurn", Hosts: 2, ContainersPerHost: 0})
	ctx := context.Background()
	h1, err := l.OpenStore("h1", "h1")
	if err != nil {
		t.Fatal(err)
	}
	defer h1.Close()
	rec, err := h1.Client.Get(ctx, store.HostKey("h1"))
	if err != nil || len(rec.Kvs) != 1 {
		t.Fatalf("h1's record: %v, %v", rec, err)
	}
	val := string(rec.Kvs[0].Value)
	status := func() uint64 {
		st, err := agentOf(t, l, "h2").Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.Reconciles
	}
	time.Sleep(300 * time.Millisecond) // h2's start-up reconciles settle
	before := status()
	start := time.Now()
	for range 1000 {
		if _, err := h1.Client.Put(ctx, store.HostKey("h1"), val); err != nil {
			t.Fatal(err)
		}
	}
	took := time.Since(start)
	time.Sleep(500 * time.Millisecond) // the trailing reconcile
	got := status() - before
	// One at once, then one per 100 ms gap, a trailing one, and slack for
	// a periodic resync.
	limit := uint64(took/(100*time.Millisecond)) + 4
	t.Logf("1 000 writes in %v: h2 reconciled %d times (limit %d)", took, got, limit)
	if got == 0 || got > limit {
		t.Errorf("h2 reconciled %d times for 1 000 writes of h1's record in %v, want 1..%d", got, took, limit)
	}
}

// TestUnderlayTakenRefused: h2 (its agent stopped, so nothing writes the
// record back) publishes h1's underlay address in its own record, which
// its certificate allows. h1's agent leaves h2 out of its hosts (no route,
// no VXLAN accepted from that address in h2's name) instead of taking it.
func TestUnderlayTakenRefused(t *testing.T) {
	l := newLab(t, Config{Name: "tunder", Hosts: 2, ContainersPerHost: 0})
	ctx := context.Background()
	if err := l.StopAgent(ctx, "h2"); err != nil {
		t.Fatal(err)
	}
	h2, err := l.OpenStore("h2", "h2")
	if err != nil {
		t.Fatal(err)
	}
	defer h2.Close()
	rec, err := h2.Host(ctx, "h2")
	if err != nil {
		t.Fatal(err)
	}
	rec.UnderlayIP = l.Hosts[0].UnderlayIP
	val, _ := json.Marshal(rec)
	if _, err := h2.Client.Put(ctx, store.HostKey("h2"), string(val)); err != nil {
		t.Fatal(err)
	}
	var names []string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		hosts, err := agentOf(t, l, "h1").Hosts(ctx)
		if err != nil {
			t.Fatal(err)
		}
		names = names[:0]
		for _, h := range hosts {
			names = append(names, h.Name)
		}
		if st, err := agentOf(t, l, "h1").Status(ctx); err == nil && len(names) == 1 && st.RemoteHosts == 0 {
			return
		}
	}
	t.Errorf("h1's hosts %v after h2 published h1's underlay address %s, want h1 alone and no remote host", names, rec.UnderlayIP)
}
