package channels

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/skiffnet/skiff/bpffs/bpffstest"
	"github.com/skiffnet/skiff/layer"
)

// TestStartAgain: the layer loads and attaches (sk_msg on its socket
// hash, sockops on the cgroup v2 root), a second start (an agent restart)
// reuses the pins, and teardown removes them.
func TestStartAgain(t *testing.T) {
	env := layer.Env{PinDir: bpffstest.Dir(t), Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for i := range 2 {
		nl, err := newLayer(nil)
		if err != nil {
			t.Fatal(err)
		}
		l := nl.(*Layer)
		if err := l.Start(context.Background(), env); err != nil {
			t.Fatalf("start %d: %v", i+1, err)
		}
		l.Close()
	}
	if removed, err := teardown(env, nil); err != nil || !removed {
		t.Errorf("teardown: %v, %v", removed, err)
	}
	if removed, err := teardown(env, nil); err != nil || removed {
		t.Errorf("teardown again: %v, %v; want nothing to remove", removed, err)
	}
}
