package seccomp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// State is what the runtime sends with the notification descriptor: the
// runtime specification's ContainerProcessState.
type State struct {
	OCIVersion string   `json:"ociVersion"`
	FDs        []string `json:"fds"`
	Pid        int      `json:"pid"`
	Metadata   string   `json:"metadata"`
	State      struct {
		ID          string            `json:"id"`
		Status      string            `json:"status"`
		Pid         int               `json:"pid"`
		Bundle      string            `json:"bundle"`
		Annotations map[string]string `json:"annotations"`
	} `json:"state"`
}

// Handoff is one container process's notification descriptor and the
// state it came with. Whoever takes it owns FD.
type Handoff struct {
	State State
	FD    *os.File
}

// maxState bounds what one hand-off may send (the state is a few hundred
// bytes; annotations make it more).
const maxState = 64 << 10

// notifyLink is what /proc/self/fd/N reads for a seccomp listener.
const notifyLink = "anon_inode:seccomp notify"

// Receiver takes notification descriptors from container runtimes on a
// Unix socket only root can reach.
type Receiver struct {
	ln  *net.UnixListener
	log *slog.Logger
}

// Listen opens the receiver's socket at path (replacing a stale one).
func Listen(path string, log *slog.Logger) (*Receiver, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("seccomp socket: %w", err)
	}
	os.Remove(path)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("seccomp socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("seccomp socket: %w", err)
	}
	return &Receiver{ln: ln, log: log}, nil
}

// Serve hands every valid hand-off to take until ctx ends or the receiver
// is closed.
func (r *Receiver) Serve(ctx context.Context, take func(Handoff)) {
	go func() {
		<-ctx.Done()
		r.ln.Close()
	}()
	for {
		c, err := r.ln.AcceptUnix()
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				r.log.Warn("seccomp socket accept", "err", err)
				time.Sleep(100 * time.Millisecond)
				continue
			}
			return
		}
		// one at a time would let one slow sender hold up every runtime
		go func() {
			h, err := receive(c)
			c.Close()
			if err != nil {
				r.log.Warn("seccomp hand-off refused", "err", err)
				return
			}
			take(h)
		}()
	}
}

// Close stops the receiver and removes its socket.
func (r *Receiver) Close() error { return r.ln.Close() }

// receive reads one hand-off: the state as JSON (up to a whole object or
// EOF), with one descriptor in SCM_RIGHTS. Only root may send one.
func receive(c *net.UnixConn) (Handoff, error) {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	raw, err := c.SyscallConn()
	if err != nil {
		return Handoff{}, err
	}
	var cred *unix.Ucred
	raw.Control(func(fd uintptr) { cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
	if err != nil {
		return Handoff{}, fmt.Errorf("peer credentials: %w", err)
	}
	var fds []int
	closeAll := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	var data []byte
	buf, oob := make([]byte, maxState+1), make([]byte, unix.CmsgSpace(4*4))
	for {
		n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
		if err != nil && !errors.Is(err, io.EOF) {
			closeAll()
			return Handoff{}, err
		}
		if oobn > 0 {
			msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				if got, e := unix.ParseUnixRights(&m); e == nil {
					fds = append(fds, got...)
				}
			}
			if perr != nil || flags&unix.MSG_CTRUNC != 0 {
				closeAll()
				return Handoff{}, errors.New("control data truncated or malformed")
			}
		}
		data = append(data, buf[:max(n, 0)]...)
		if len(data) > maxState {
			closeAll()
			return Handoff{}, fmt.Errorf("state larger than %d bytes", maxState)
		}
		// runc sends the state in one message and may keep the
		// connection open: a whole JSON object ends it, as EOF does
		if err != nil || n == 0 || json.Valid(data) {
			break
		}
	}
	if cred.Uid != 0 {
		closeAll()
		return Handoff{}, fmt.Errorf("sent by uid %d, not root", cred.Uid)
	}
	h, err := parse(data, fds)
	if err != nil {
		closeAll()
		return Handoff{}, err
	}
	return h, nil
}

// parse checks a hand-off's state and descriptors.
func parse(data []byte, fds []int) (Handoff, error) {
	var st State
	if err := json.Unmarshal(data, &st); err != nil {
		return Handoff{}, fmt.Errorf("state: %w", err)
	}
	if st.Metadata != Metadata {
		return Handoff{}, fmt.Errorf("metadata %q: not from skiff's profile (want %q)", st.Metadata, Metadata)
	}
	if len(fds) != 1 || !slices.Equal(st.FDs, []string{"seccompFd"}) {
		return Handoff{}, fmt.Errorf("%d descriptors named %v, want one seccompFd", len(fds), st.FDs)
	}
	if link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fds[0])); err != nil || link != notifyLink {
		return Handoff{}, fmt.Errorf("the descriptor is %q, not a seccomp listener", link)
	}
	if st.Pid <= 0 {
		return Handoff{}, fmt.Errorf("state without a process (pid %d)", st.Pid)
	}
	unix.CloseOnExec(fds[0])
	return Handoff{State: st, FD: os.NewFile(uintptr(fds[0]), "seccomp-notify")}, nil
}

// Hung reports whether no process uses f's filter any more.
func Hung(f *os.File) bool {
	pfd := []unix.PollFd{{Fd: int32(f.Fd()), Events: unix.POLLIN}}
	n, err := unix.Poll(pfd, 0)
	return err == nil && n == 1 && pfd[0].Revents&unix.POLLHUP != 0
}
