package lab

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"
)

// BenchmarkCNIAdd measures CNI ADD latency (libcni to skiff-cni to the
// agent, which leases an address and writes the endpoint in the store)
// with the store on TLS and on plain HTTP: two labs side by side, ADDs
// alternating between them so both see the same machine. It reports the
// median of 100 ADDs per lab for each b.N (run it with -benchtime 1x):
//
//	flock /tmp/skiff-lab.lock go test -run '^$' -bench CNIAdd -benchtime 1x ./lab/
func BenchmarkCNIAdd(b *testing.B) {
	const adds = 100
	labs := map[string]*Lab{}
	for _, v := range []struct {
		name     string
		insecure bool
	}{{"btls", false}, {"bplain", true}} {
		l := newLab(b, Config{Name: v.name, Hosts: 2, ContainersPerHost: 0, EtcdInsecure: v.insecure})
		labs[v.name] = l
	}
	ctx := context.Background()
	took := map[string][]time.Duration{}
	for range b.N {
		for i := range adds {
			for _, name := range []string{"btls", "bplain"} {
				l := labs[name]
				c := Container{Name: fmt.Sprintf("h1/b%d", i), Host: "h1", Netns: fmt.Sprintf("%sh1-b%d", l.prefix(), i)}
				c.ID = c.Netns
				if err := addNetns(c.Netns); err != nil {
					b.Fatal(err)
				}
				start := time.Now()
				ip, err := l.cniAdd(ctx, c)
				took[name] = append(took[name], time.Since(start))
				if err != nil {
					b.Fatalf("%s: ADD %s: %v", name, c.Name, err)
				}
				c.IP = ip
				l.Containers = append(l.Containers, c)
			}
		}
		for _, l := range labs {
			for _, c := range slices.Clone(l.Containers) {
				if err := l.RemoveContainer(ctx, c.Name); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	median := func(d []time.Duration) time.Duration {
		d = slices.Clone(d)
		slices.Sort(d)
		return d[len(d)/2]
	}
	tlsMed, plainMed := median(took["btls"]), median(took["bplain"])
	b.ReportMetric(float64(tlsMed.Microseconds()), "tls-p50-µs")
	b.ReportMetric(float64(plainMed.Microseconds()), "plain-p50-µs")
	b.ReportMetric(float64(tlsMed)/float64(plainMed), "tls/plain")
}
