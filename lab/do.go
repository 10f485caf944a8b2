package lab

import (
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
)

// Do runs f with the calling goroutine's OS thread inside target's network
// namespace. Sockets f creates stay in that namespace after Do returns, so
// tests can listen and dial from any lab host or container in-process.
// Goroutines f starts do not inherit the namespace.
func (l *Lab) Do(target string, f func() error) error {
	name, err := l.Netns(target)
	if err != nil {
		return err
	}
	return inNetns(name, f)
}

// inNetns runs f on an OS thread inside the named network namespace.
func inNetns(name string, f func() error) error {
	errc := make(chan error, 1)
	// A fresh goroutine: if restoring the namespace fails, the thread dies
	// with it (no UnlockOSThread) instead of being reused in the wrong one.
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("current netns: %w", err)
			return
		}
		defer orig.Close()
		ns, err := netns.GetFromName(name)
		if err != nil {
			errc <- fmt.Errorf("open netns %s: %w", name, err)
			return
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			errc <- fmt.Errorf("enter netns %s: %w", name, err)
			return
		}
		ferr := f()
		if err := netns.Set(orig); err != nil {
			errc <- fmt.Errorf("leave netns %s: %w", name, err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// Do runs f inside the container's network namespace, as Lab.Do does; for
// a container not yet recorded in the lab (AddContainersThen's).
func (c Container) Do(f func() error) error { return inNetns(c.Netns, f) }
