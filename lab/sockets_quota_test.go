package lab

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/skiffnet/skiff/sockets"
	"github.com/skiffnet/skiff/store"
)

// pyChurn opens and closes a replaced listener on port argv[1] for
// argv[2] seconds, each held argv[3] seconds, and prints how many times.
const pyChurn = `
import socket, sys, time
port, until, hold = int(sys.argv[1]), time.time() + float(sys.argv[2]), float(sys.argv[3])
n = 0
while time.time() < until:
    s = socket.socket()
    s.bind(("0.0.0.0", port))
    s.listen()
    time.sleep(hold)
    s.close()
    n += 1
print(n)
`

// TestSocketsListenerChurn: a container that opens and closes a replaced
// listener in a loop costs the cluster store at most about one write a
// second (its host's agent gathers the changes), not one per listen and
// close, which kept etcd and every agent busy; when it stops, the store
// holds no listener of it. Status shows each container's ports against
// its quota and the publishing.
func TestSocketsListenerChurn(t *testing.T) {
	l := newLab(t, Config{Name: "tskchurn", Hosts: 2, ContainersPerHost: 1, Mode: "sockets"})
	ctx := context.Background()
	st, err := l.OpenStore("h1", "h1")
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	revision := func() int64 {
		t.Helper()
		resp, err := st.Client.Get(ctx, store.ListenerPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	before, added := revision(), counter(t, l, "h1", "listener_added")
	const seconds = 4
	// Each listener held 20 ms: long enough to be seen, as a server's
	// would, so that every listen and close was a write before.
	cmd, err := l.Command(ctx, "h1/c1", "python3", "-c", pyChurn, "9100", strconv.Itoa(seconds), "0.02")
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	loops, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil || loops < 50 {
		t.Fatalf("listen/close loop: %q", out)
	}
	if n := counter(t, l, "h1", "listener_added") - added; n < uint64(loops) {
		t.Fatalf("%d listeners replaced of %d: the loop did not run on host sockets", n, loops)
	}
	// The last change is written within a publish interval.
	_, err = eventually(5*time.Second, func() error {
		if n := len(socketsStatus(t, l, "h1").Listeners); n != 0 {
			return fmt.Errorf("%d listeners left", n)
		}
		resp, err := st.Client.Get(ctx, store.ListenerPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil || resp.Count != 0 {
			return fmt.Errorf("%d listeners in the store (%v)", resp.Count, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	writes := revision() - before
	t.Logf("%d listens and closes in %d s: %d store writes", loops, seconds, writes)
	if limit := int64(2*seconds + 8); writes > limit {
		t.Errorf("%d listens and closes in %d s took %d store writes, want at most %d", loops, seconds, writes, limit)
	}
	s := socketsStatus(t, l, "h1")
	if s.ListenerQuota != sockets.DefaultListenerQuota || len(s.Containers) != 1 || s.Containers[0].Ports != 0 ||
		s.Publish == nil || s.Publish.Writes == 0 || s.Publish.Error != "" {
		t.Errorf("status: quota %d, containers %+v, publish %+v", s.ListenerQuota, s.Containers, s.Publish)
	}
}
