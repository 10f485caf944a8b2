package seccomp

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestParse(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	good := `{"ociVersion":"1.0.2","fds":["seccompFd"],"pid":1,"metadata":"skiff/v1","state":{"id":"c"}}`
	for name, c := range map[string]struct {
		state string
		fds   []int
		want  string
	}{
		"not json":      {`{"fds":`, []int{int(r.Fd())}, "state"},
		"metadata":      {strings.Replace(good, "skiff/v1", "other", 1), []int{int(r.Fd())}, "metadata"},
		"no fd":         {good, nil, "descriptors"},
		"two fds":       {good, []int{int(r.Fd()), int(w.Fd())}, "descriptors"},
		"fd names":      {strings.Replace(good, `["seccompFd"]`, `["other"]`, 1), []int{int(r.Fd())}, "descriptors"},
		"not seccomp":   {good, []int{int(r.Fd())}, "not a seccomp listener"},
		"no process":    {strings.Replace(good, `"pid":1,`, ``, 1), []int{int(r.Fd())}, "seccomp listener"},
		"empty":         {``, nil, "state"},
		"bad pid type":  {strings.Replace(good, `"pid":1`, `"pid":"x"`, 1), []int{int(r.Fd())}, "state"},
		"metadata none": {strings.Replace(good, `"metadata":"skiff/v1",`, ``, 1), []int{int(r.Fd())}, "metadata"},
	} {
		if _, err := parse([]byte(c.state), c.fds); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error about %q", name, err, c.want)
		}
	}
}

// A runtime's hand-off that is not one is refused, and the receiver goes
// on serving: garbage, a pipe instead of a listener, a sender that
// leaves without sending, one that sends nothing for long.
func TestReceiverRefuses(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the receiver takes hand-offs from root only")
	}
	path := filepath.Join(t.TempDir(), "seccomp.sock")
	r, err := Listen(path, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(path)
	if st.Mode().Perm() != 0o600 {
		t.Errorf("socket mode %v, want 0600", st.Mode().Perm())
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	took := make(chan Handoff, 4)
	go r.Serve(ctx, func(h Handoff) { took <- h })
	pr, pw, _ := os.Pipe()
	defer pr.Close()
	defer pw.Close()
	send := func(state string, fd int) {
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		var oob []byte
		if fd >= 0 {
			oob = unix.UnixRights(fd)
		}
		if _, _, err := c.(*net.UnixConn).WriteMsgUnix([]byte(state), oob, nil); err != nil {
			t.Fatal(err)
		}
	}
	send("garbage", -1)
	send(`{"ociVersion":"1.0.2","fds":["seccompFd"],"pid":1,"metadata":"skiff/v1"}`, int(pr.Fd()))
	if c, err := net.Dial("unix", path); err == nil {
		c.Close()
	}
	select {
	case h := <-took:
		t.Fatalf("took a hand-off: %+v", h.State)
	case <-time.After(500 * time.Millisecond):
	}
	cancel()
	time.Sleep(50 * time.Millisecond)
	if _, err := net.Dial("unix", path); err == nil {
		t.Error("the receiver still accepts after its context ended")
	}
}
