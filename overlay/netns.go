package overlay

import (
	"fmt"
	"runtime"
	"unsafe"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/skiffnet/skiff/cluster"
)

// NetnsCookie returns the cookie of the calling thread's network
// namespace (what eBPF's bpf_get_netns_cookie gives its sockets).
func NetnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("netns cookie: %w", err)
	}
	defer unix.Close(fd)
	var cookie uint64
	size := uint32(unsafe.Sizeof(cookie))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_NETNS_COOKIE,
		uintptr(unsafe.Pointer(&cookie)), uintptr(unsafe.Pointer(&size)), 0)
	if errno != 0 {
		return 0, fmt.Errorf("netns cookie: %w", errno)
	}
	return cookie, nil
}

// InNetns runs f on an OS thread in e's network namespace (what only a
// thread's namespace decides: a socket's, a socket iterator's), in a
// goroutine of its own: a thread that cannot go back to the agent's
// namespace ends with that goroutine, never to run anything else.
func InNetns(e cluster.Endpoint, f func() error) error {
	ns, err := OpenNetns(e)
	if err != nil {
		return err
	}
	defer ns.Close()
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			done <- fmt.Errorf("this thread's namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(ns); err != nil {
			done <- fmt.Errorf("enter %s: %w", e.Netns, err)
			return
		}
		ferr := f()
		if err := netns.Set(orig); err != nil {
			done <- fmt.Errorf("back from %s: %w", e.Netns, err)
			return // still locked: the thread ends here
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}
