package scale

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/bench"
	"github.com/skiffnet/skiff/lab"
	"github.com/skiffnet/skiff/policy"
	"github.com/skiffnet/skiff/store"
)

// RulesPoint is a cluster with Rules policy rules in force.
type RulesPoint struct {
	Rules int `json:"rules"`
	// PutSeconds: the administrator writing them, one at a time, 16 at
	// once.
	PutSeconds float64 `json:"putSeconds"`
	// ChangeMs: from one rule written (an allow before a deny of one
	// flow between two hosts) until that flow connects: the change
	// applied on both hosts. Add: five pods' ADDs, one after the other.
	ChangeMs float64 `json:"changeMs"`
	Add      Spread  `json:"add"`
	// TCPRR and TCPCRR are auto's paired ratios to host in this state.
	TCPRR  *bench.Paired `json:"tcpRR"`
	TCPCRR *bench.Paired `json:"tcpCRR"`
}

const changePort = 7100

func runRules(ctx context.Context, o Options) ([]RulesPoint, error) {
	const name = "srules"
	o.logf("rules: lab %s (2 hosts, 2 pods each, auto)", name)
	l, err := up(ctx, o, name, 2, 2)
	if err != nil {
		return nil, err
	}
	defer down(o, name)
	ln, err := listen(l, "h2/c2", changePort)
	if err != nil {
		return nil, err
	}
	defer ln.Close()
	var out []RulesPoint
	for _, n := range o.Rules {
		p, err := rules(ctx, o, l, n)
		if err != nil {
			return out, fmt.Errorf("%d rules: %w", n, err)
		}
		o.logf("rules %d: put in %.1f s, one change applied in %.0f ms, ADD p50 %.0f ms, auto/host tcp_rr %s tcp_crr %s",
			n, p.PutSeconds, p.ChangeMs, p.Add.P50, paired(p.TCPRR), paired(p.TCPCRR))
		out = append(out, p)
	}
	return out, nil
}

func rules(ctx context.Context, o Options, l *lab.Lab, n int) (RulesPoint, error) {
	p := RulesPoint{Rules: n}
	src, err := l.IP("h1/c2")
	if err != nil {
		return p, err
	}
	dst, err := l.IP("h2/c2")
	if err != nil {
		return p, err
	}
	probe := policy.Rule{ID: "probe-deny", Priority: 50, Action: policy.Deny, Src: netip.PrefixFrom(src, 32),
		Dst: netip.PrefixFrom(dst, 32), Proto: policy.TCP, Port: changePort}
	set := append(filler(n-1), probe)
	start := time.Now()
	if err := putRules(ctx, l, set); err != nil {
		return p, err
	}
	p.PutSeconds = time.Since(start).Seconds()
	defer clearRules(ctx, l)

	// the deny in force on both hosts: the flow fails
	to := netip.AddrPortFrom(dst, changePort)
	if err := waitDenied(l, to, 60*time.Second); err != nil {
		return p, err
	}
	if err := quiet(ctx, l, 60*time.Second); err != nil {
		return p, err
	}
	allow := probe
	allow.ID, allow.Priority, allow.Action = "probe-allow", 10, policy.Allow
	start = time.Now()
	if err := l.PutPolicy(ctx, allow); err != nil {
		return p, err
	}
	took, err := reach(func(f func() error) error { return l.Do("h1/c2", f) }, to, start, 30*time.Second)
	if err != nil {
		return p, fmt.Errorf("after the allow: %w", err)
	}
	p.ChangeMs = millis(took)

	var adds []float64
	var names []string
	for range 5 {
		start := time.Now()
		c, err := l.AddContainer(ctx, "h1")
		if err != nil {
			return p, err
		}
		adds = append(adds, millis(time.Since(start)))
		names = append(names, c)
	}
	p.Add = spreadOf(adds)
	if _, err := l.RemoveContainers(ctx, names...); err != nil {
		return p, err
	}

	rep, err := bench.Run(ctx, l, bench.Options{Modes: []string{"host", "auto"}, Workloads: []string{"tcp_rr", "tcp_crr"},
		Repeat: o.Repeat, CellDuration: o.Cell, PerfBin: filepath.Join(o.BinDir, "skiff-perf")})
	if rep == nil {
		return p, err
	}
	p.TCPRR, p.TCPCRR = autoRatio(rep, "tcp_rr"), autoRatio(rep, "tcp_crr")
	return p, err
}

// autoRatio is auto's paired ratio to host on workload's primary metric.
func autoRatio(r *bench.Report, workload string) *bench.Paired {
	for _, res := range r.Results {
		if res.Workload == workload && res.Mode == "auto" && res.Paired != nil {
			return res.Paired
		}
	}
	return nil
}

// filler is n rules that match no flow of the lab (sources in a part of
// the cluster network no host owns), each different: the compiler has
// to keep every one.
func filler(n int) []policy.Rule {
	out := make([]policy.Rule, n)
	for i := range out {
		src := netip.AddrFrom4([4]byte{10, 244, byte(200 + i/256%50), byte(i % 256)})
		out[i] = policy.Rule{ID: fmt.Sprintf("filler-%d", i), Priority: 1000 + i, Action: policy.Deny,
			Src: netip.PrefixFrom(src, 32), Proto: policy.TCP, Port: uint16(1 + i%60000)}
	}
	return out
}

// putRules writes rules as the administrator, 16 at once.
func putRules(ctx context.Context, l *lab.Lab, rules []policy.Rule) error {
	return l.Admin(func(s *store.Store) error {
		work := make(chan policy.Rule)
		errs := make(chan error, 16)
		var wg sync.WaitGroup
		for range 16 {
			wg.Go(func() {
				for r := range work {
					if err := s.PutPolicy(ctx, r); err != nil {
						errs <- fmt.Errorf("rule %s: %w", r.ID, err)
						return
					}
				}
			})
		}
		for _, r := range rules {
			select {
			case work <- r:
			case err := <-errs:
				close(work)
				wg.Wait()
				return err
			}
		}
		close(work)
		wg.Wait()
		select {
		case err := <-errs:
			return err
		default:
			return nil
		}
	})
}

// clearRules deletes every rule at once.
func clearRules(ctx context.Context, l *lab.Lab) error {
	return l.Admin(func(s *store.Store) error {
		_, err := s.Client.Delete(ctx, store.PolicyPrefix, clientv3.WithPrefix())
		return err
	})
}

// waitDenied waits until connections from h1/c2 to to are refused, three
// in a row (the deny's REJECT; a timeout is not the policy's answer).
func waitDenied(l *lab.Lab, to netip.AddrPort, timeout time.Duration) error {
	return l.Do("h1/c2", func() error {
		refused := 0
		for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			c, err := netDial(to)
			switch {
			case err == nil:
				c.Close()
				refused = 0
			case errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH):
				if refused++; refused == 3 {
					return nil
				}
			default:
				refused = 0
			}
		}
		return fmt.Errorf("%s not refused three times in a row in %s after the deny", to, timeout)
	})
}

// quiet waits until no agent of the lab has reconciled for a second (at
// most timeout): a change is then timed alone, not behind the backlog of
// the ones before.
func quiet(ctx context.Context, l *lab.Lab, timeout time.Duration) error {
	last, err := reconciles(ctx, l)
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); {
		time.Sleep(time.Second)
		n, err := reconciles(ctx, l)
		if err != nil {
			return err
		}
		if n == last {
			return nil
		}
		last = n
	}
	return err
}
