package broker

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/sockets/broker/seccomp"
)

// pyBursts connects to argv[1] argv[2] times for every line it reads, and
// answers each burst with "ok".
const pyBursts = `
import socket, sys
h, p = sys.argv[1].rsplit(":", 1)
for _ in sys.stdin:
    for _ in range(int(sys.argv[2])):
        socket.create_connection((h, int(p)), timeout=5).close()
    print("ok", flush=True)
`

// TestKeeperReceiveBounded: two holders of one seccomp listener (a keeper
// given a listener while its broker still runs) both wake for a
// notification and only one receives it. The other's receive must not wait
// for the filter's next notification, which may never come: it gives up
// within a bound and goes back to its loop. Here the other holder is a
// process of the test's own that always waits in a receive already, so it
// takes most notifications and the keeper loses the race often; before,
// the keeper then stayed in SECCOMP_IOCTL_NOTIF_RECV until the filter's
// next call.
func TestKeeperReceiveBounded(t *testing.T) {
	bin := os.Getenv("SKIFF_BIN_DIR")
	if bin == "" {
		t.Skip("needs the built binaries (SKIFF_BIN_DIR, as make test sets it)")
	}
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("needs python3")
	}
	dir := t.TempDir()
	filter := filepath.Join(dir, "filter.bpf")
	if err := os.WriteFile(filter, seccomp.FilterBytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "seccomp.sock")
	r, err := seccomp.Listen(sock, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	handoffs := make(chan seccomp.Handoff, 1)
	go r.Serve(ctx, func(h seccomp.Handoff) { handoffs <- h })

	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()

	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctl, theirs := fds[0], os.NewFile(uintptr(fds[1]), "control")
	defer unix.Close(ctl)
	var klog bytes.Buffer
	keeper := exec.Command(filepath.Join(bin, "skiff-broker"), "--keeper", "--control-fd", "3")
	keeper.ExtraFiles = []*os.File{theirs}
	keeper.Stderr = &klog
	err = keeper.Start()
	theirs.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		keeper.Process.Kill()
		keeper.Wait()
		if t.Failed() {
			t.Logf("keeper log:\n%s", klog.String())
		}
	}()

	const burst = 1
	p := exec.Command(filepath.Join(bin, "skiff-seccomp-exec"), "--filter", filter, "--socket", sock, "--id", "racer", "--",
		py, "-c", pyBursts, ln.Addr().String(), fmt.Sprint(burst))
	in, err := p.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := p.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var perr bytes.Buffer
	p.Stderr = &perr
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		in.Close()
		p.Process.Kill()
		p.Wait()
	}()
	var h seccomp.Handoff
	select {
	case h = <-handoffs:
	case <-time.After(10 * time.Second):
		t.Fatalf("no listener from skiff-seccomp-exec: %s", perr.String())
	}
	defer h.FD.Close()
	if err := unix.Sendmsg(ctl, []byte{'L'}, unix.UnixRights(int(h.FD.Fd())), nil, 0); err != nil {
		t.Fatal(err)
	}
	other := exec.Command(os.Args[0], "-test.run=^TestReceiverHelper$")
	other.Env = append(os.Environ(), "SKIFF_TEST_RECEIVER=1")
	other.ExtraFiles = []*os.File{h.FD}
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		other.Process.Kill() // a receive ends with SIGKILL
		other.Wait()
	}()

	lines := bufio.NewScanner(out)
	stuck := 0
	const rounds = 150
	for round := 0; round < rounds; round++ {
		if _, err := io.WriteString(in, "\n"); err != nil {
			t.Fatal(err)
		}
		done := make(chan bool, 1)
		go func() { done <- lines.Scan() && lines.Text() == "ok" }()
		select {
		case ok := <-done:
			if !ok {
				t.Fatalf("round %d: the burst failed: %s", round, perr.String())
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: the burst of %d connects did not end: %s", round, burst, perr.String())
		}
		// The bound is 100 ms: well past it, neither keeper may still
		// wait in a receive.
		time.Sleep(150 * time.Millisecond)
		if receiving(keeper.Process.Pid) {
			stuck++
		}
	}
	if stuck > 0 {
		t.Errorf("%d of %d checks found the keeper still in SECCOMP_IOCTL_NOTIF_RECV 150 ms after the filter's last call", stuck, rounds)
	}
}

// receiving says whether process pid is in a SECCOMP_IOCTL_NOTIF_RECV
// ioctl (/proc/PID/syscall: the number, then the arguments in hex).
func receiving(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/syscall", pid))
	if err != nil {
		return false
	}
	f := strings.Fields(string(b))
	return len(f) > 2 && f[0] == fmt.Sprint(unix.SYS_IOCTL) && f[2] == fmt.Sprintf("%#x", unix.SECCOMP_IOCTL_NOTIF_RECV)
}

// TestReceiverHelper is TestKeeperReceiveBounded's other holder, run in a
// process of its own: it receives notifications on descriptor 3 and
// continues each, until killed.
func TestReceiverHelper(t *testing.T) {
	if os.Getenv("SKIFF_TEST_RECEIVER") != "1" {
		t.Skip("a helper process of TestKeeperReceiveBounded")
	}
	const fd = 3
	var req [80]byte  // struct seccomp_notif
	var resp [24]byte // struct seccomp_notif_resp
	for {
		clear(req[:])
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, fd, unix.SECCOMP_IOCTL_NOTIF_RECV, uintptr(unsafe.Pointer(&req[0]))); e != 0 {
			if e == unix.EINTR || e == unix.ENOENT {
				continue
			}
			t.Fatalf("receive: %v", e)
		}
		clear(resp[:])
		copy(resp[:8], req[:8]) // id
		binary.NativeEndian.PutUint32(resp[20:], unix.SECCOMP_USER_NOTIF_FLAG_CONTINUE)
		unix.Syscall(unix.SYS_IOCTL, fd, unix.SECCOMP_IOCTL_NOTIF_SEND, uintptr(unsafe.Pointer(&resp[0])))
	}
}
