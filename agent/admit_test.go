package agent

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/skiffnet/skiff/api"
	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/source"
)

// batchStore is a store of one host's endpoints that takes its time to
// answer (as a store over the network does) and counts the calls.
type batchStore struct {
	source.Backend // what admission does not call
	mu             sync.Mutex
	eps            []cluster.Endpoint
	next           int
	reads, batches atomic.Int32
}

func (s *batchStore) Endpoints(context.Context, string) ([]cluster.Endpoint, error) {
	s.reads.Add(1)
	time.Sleep(2 * time.Millisecond)
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]cluster.Endpoint(nil), s.eps...), nil
}

func (s *batchStore) AllocateAll(_ context.Context, subnet netip.Prefix, wants []cluster.Endpoint) ([]cluster.Endpoint, []error) {
	s.batches.Add(1)
	time.Sleep(2 * time.Millisecond)
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]cluster.Endpoint, len(wants))
	for i, w := range wants {
		s.next++
		w.IP = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 244, 1, byte(1 + s.next)}), subnet.Bits())
		s.eps = append(s.eps, w)
		out[i] = w
	}
	return out, make([]error, len(wants))
}

// TestAdmitTogether: 60 ADDs at once are admitted in far fewer store
// steps than 60, each gets an address of its own, and of two ADDs that
// claim one cgroup, in one batch or not, the second is refused.
func TestAdmitTogether(t *testing.T) {
	s := &batchStore{}
	a := &Agent{store: s, host: cluster.Host{Name: "h1", Subnet: netip.MustParsePrefix("10.244.1.0/24")}}
	const n = 60
	var wg sync.WaitGroup
	got := make([]cluster.Endpoint, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			req := api.AddRequest{ContainerID: fmt.Sprintf("c%d", i), IfName: "eth0", Netns: "/run/netns/x",
				Cgroup: fmt.Sprintf("/sys/fs/cgroup/pod/c%d", i%(n-1))} // c0 and c59 share one
			got[i], _, _, errs[i] = a.admitEndpoint(t.Context(), req, 1, uint64(i), false)
		})
	}
	wg.Wait()
	ips := map[netip.Addr]bool{}
	refused := 0
	for i := range n {
		if errs[i] != nil {
			if !strings.Contains(errs[i].Error(), "cgroup") {
				t.Errorf("c%d: %v", i, errs[i])
			}
			refused++
			continue
		}
		if ips[got[i].IP.Addr()] {
			t.Errorf("%s twice", got[i].IP)
		}
		ips[got[i].IP.Addr()] = true
		if got[i].MAC == "" || got[i].NetnsIno != uint64(i) {
			t.Errorf("c%d's record is not complete: %+v", i, got[i])
		}
	}
	if refused != 1 {
		t.Errorf("%d ADDs refused, want 1 (c0 and c59 share a cgroup)", refused)
	}
	if b := s.batches.Load(); b >= n/2 || s.reads.Load() != b {
		t.Errorf("%d batches and %d reads for %d ADDs", b, s.reads.Load(), n)
	}
	t.Logf("%d ADDs in %d batches", n, s.batches.Load())
}
