package steering

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"

	"github.com/skiffnet/skiff/tc"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// A device's RPS masks live in sysfs, whose network directories show the
// devices of the namespace that mounted it. skiffd may run in a network
// namespace without a sysfs of its own (the lab's agents share the
// machine's mounts): every read and write goes through a sysfs mounted
// for the namespace meant, in a mount namespace of one thread, as
// `ip netns exec` does.

// inSysfs runs f with the root of a sysfs of network namespace ns (nil:
// the caller's), on a thread that ends afterwards.
func inSysfs(ns *netns.NsHandle, f func(sys string) error) error {
	done := make(chan error, 1)
	go func() {
		// Never unlocked: the thread's namespaces are changed, and it
		// ends with the goroutine.
		runtime.LockOSThread()
		done <- func() error {
			if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
				return fmt.Errorf("mount namespace: %w", err)
			}
			if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
				return fmt.Errorf("make mounts private: %w", err)
			}
			if ns != nil {
				if err := netns.Set(*ns); err != nil {
					return fmt.Errorf("enter network namespace: %w", err)
				}
			}
			dir, err := os.MkdirTemp("", "skiff-sysfs-")
			if err != nil {
				return err
			}
			defer os.Remove(dir)
			if err := unix.Mount("sysfs", dir, "sysfs", 0, ""); err != nil {
				return fmt.Errorf("mount sysfs: %w", err)
			}
			defer unix.Unmount(dir, unix.MNT_DETACH)
			return f(dir)
		}()
	}()
	return <-done
}

// rxQueues returns the rps_cpus files of device dev under sysfs root sys.
func rxQueues(sys, dev string) ([]string, error) {
	files, err := filepath.Glob(filepath.Join(sys, "class/net", dev, "queues/rx-*/rps_cpus"))
	if err == nil && len(files) == 0 {
		err = fmt.Errorf("device %s has no receive queues with RPS (%s)", dev, sys)
	}
	return files, err
}

// setRPS writes mask into every receive queue of dev.
func setRPS(sys, dev, mask string) error {
	files, err := rxQueues(sys, dev)
	if err != nil {
		return err
	}
	for _, f := range files {
		if err := os.WriteFile(f, []byte(mask), 0); err != nil {
			return fmt.Errorf("%s rps_cpus: %w", dev, err)
		}
	}
	return nil
}

// rpsOf reads the mask of dev's first receive queue.
func rpsOf(sys, dev string) (string, error) {
	files, err := rxQueues(sys, dev)
	if err != nil {
		return "", err
	}
	b, err := os.ReadFile(files[0])
	return strings.TrimSpace(string(b)), err
}

// written are the masks the layer wrote, kept in the state directory so
// that a later start without the layer puts the kernel's default (none)
// back: by device, for the host's namespace ("" ) or a container's
// (its namespace's path).
type written struct {
	Masks map[string]string `json:"masks"` // "netns|device" → the mask written
}

func stateFile(stateDir string) string { return filepath.Join(stateDir, "steering-rps.json") }

// readWritten reads the state file. One that cannot be read as such is
// moved aside (the masks it listed stay as they are), with a warning.
func readWritten(stateDir string, log *slog.Logger) written {
	w := written{Masks: map[string]string{}}
	b, err := os.ReadFile(stateFile(stateDir))
	if errors.Is(err, os.ErrNotExist) {
		return w
	}
	if err == nil {
		err = json.Unmarshal(b, &w)
	}
	if err != nil {
		log.Warn("steering state unreadable: moved aside, the RPS masks it listed stay", "file", stateFile(stateDir), "err", err)
		os.Rename(stateFile(stateDir), stateFile(stateDir)+".bad")
		w.Masks = nil
	}
	if w.Masks == nil {
		w.Masks = map[string]string{}
	}
	return w
}

func (w written) save(stateDir string) error {
	if len(w.Masks) == 0 {
		err := os.Remove(stateFile(stateDir))
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	b, err := json.Marshal(w)
	if err != nil {
		return err
	}
	tmp := stateFile(stateDir) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, stateFile(stateDir))
}

func maskKey(nsPath, dev string) string { return nsPath + "|" + dev }

// steerDevice writes mask on dev in namespace nsPath ("": the caller's)
// and records it.
func (w written) steerDevice(stateDir, nsPath, dev, mask string) error {
	err := inNamespaceSysfs(nsPath, func(sys string) error { return setRPS(sys, dev, mask) })
	if err != nil {
		return err
	}
	w.Masks[maskKey(nsPath, dev)] = mask
	return w.save(stateDir)
}

// restore puts the kernel's default (no RPS) back on every device the
// layer steered whose mask is still the one written (someone else's
// change stays), and forgets them. A container's namespace that is gone
// or cannot be entered is forgotten with a warning: a failure here must
// not keep the agent from starting.
func (w written) restore(stateDir string, log *slog.Logger) error {
	for key, mask := range w.Masks {
		nsPath, dev, _ := strings.Cut(key, "|")
		err := inNamespaceSysfs(nsPath, func(sys string) error {
			now, err := rpsOf(sys, dev)
			if err != nil || !sameMask(now, mask) {
				return nil // gone, or changed by someone else
			}
			return setRPS(sys, dev, "0")
		})
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			log.Warn("RPS mask not restored", "netns", nsPath, "device", dev, "err", err)
		}
		delete(w.Masks, key)
	}
	return w.save(stateDir)
}

// sameMask compares two masks as the CPU sets they stand for (the kernel
// prints a mask zero-padded to the number of possible CPUs).
func sameMask(a, b string) bool {
	x, err1 := ParseMask(a)
	y, err2 := ParseMask(b)
	return err1 == nil && err2 == nil && slices.Equal(x, y)
}

// inNamespaceSysfs runs f with a sysfs of the namespace at nsPath (""
// the caller's).
func inNamespaceSysfs(nsPath string, f func(sys string) error) error {
	if nsPath == "" {
		return inSysfs(nil, f)
	}
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return fmt.Errorf("namespace %s: %w", nsPath, err)
	}
	defer ns.Close()
	return inSysfs(&ns, f)
}

// detach removes the layer's filters from the host's devices and from the
// containers' namespaces it steered (those still there).
func (w written) detach() error {
	errs := []error{tc.DetachAll(&netlink.Handle{}, filterName)}
	for key := range w.Masks {
		if nsPath, _, _ := strings.Cut(key, "|"); nsPath != "" {
			ns, err := netns.GetFromPath(nsPath)
			if err != nil {
				continue // the container is gone, and its interface with it
			}
			h, err := netlink.NewHandleAt(ns)
			ns.Close()
			if err != nil {
				errs = append(errs, fmt.Errorf("steering: netlink in %s: %w", nsPath, err))
				continue
			}
			errs = append(errs, tc.DetachAll(h, filterName))
			h.Close()
		}
	}
	return errors.Join(errs...)
}
