package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/skiffnet/skiff/iptables"
	"github.com/skiffnet/skiff/layer"
	"github.com/skiffnet/skiff/limits"
	"github.com/skiffnet/skiff/netlinksafe"
	"github.com/skiffnet/skiff/overlay"
	"github.com/skiffnet/skiff/tc"
)

// CleanupConfig says where an agent kept its state (skiffd's flags of the
// same names).
type CleanupConfig struct {
	StateDir string
	BPFDir   string
	Socket   string
	// LayerOptions are the layers' options, by name (their teardowns read
	// them: the sockets layer's seccomp socket).
	LayerOptions map[string]any
	// Keep are paths under StateDir that stay (an embedded etcd's data).
	Keep []string
}

// Cleanup removes what skiffd made on this host (skiffd --cleanup), with
// the agent stopped: every layer's programs, links, routes and brokers (the
// layers' own teardowns), skiff's tc filters on every device, its devices
// (the bridge, the VXLAN device, the IFB and the containers' veths, which
// disconnects the containers still there), its iptables chains, its
// pinned eBPF state and its files. It works from what it finds, so a
// second run removes nothing and succeeds, and returns what it removed.
func Cleanup(cfg CleanupConfig, log *slog.Logger) ([]string, error) {
	if c, err := net.DialTimeout("unix", cfg.Socket, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("skiffd is running (it answers on %s): stop it first (systemctl stop skiffd)", cfg.Socket)
	}
	if cfg.BPFDir == "" {
		return nil, errors.New("cleanup needs the bpf directory (--bpf-dir)")
	}
	var removed []string
	var errs []error
	// The cached identity gives the layers the cluster they were built for.
	var id identity
	if data, err := os.ReadFile(filepath.Join(cfg.StateDir, "identity.json")); err == nil {
		if err := json.Unmarshal(data, &id); err != nil {
			log.Warn("the cached identity is unreadable; the layers are removed without it", "err", err)
		}
	}
	for _, r := range layer.Registered() {
		env := layer.Env{Cluster: id.Cluster, Host: id.Host, PinDir: filepath.Join(cfg.BPFDir, r.Name), StateDir: cfg.StateDir,
			Log: log.With("layer", r.Name)}
		if done, err := r.Teardown(env, cfg.LayerOptions[r.Name]); err != nil {
			errs = append(errs, fmt.Errorf("remove layer %s: %w", r.Name, err))
		} else if done {
			removed = append(removed, "layer "+r.Name)
		}
	}
	links, err := netlinksafe.Dump(netlink.LinkList)
	if err != nil {
		return removed, errors.Join(append(errs, fmt.Errorf("list links: %w", err))...)
	}
	h := &netlink.Handle{}
	for _, lk := range links {
		name := lk.Attrs().Name
		if ours(name) {
			if err := netlink.LinkDel(lk); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("delete %s: %w", name, err))
			} else {
				removed = append(removed, "device "+name)
			}
			continue
		}
		n, err := tc.DetachPrefix(h, lk, "skiff-")
		if err != nil {
			errs = append(errs, err)
		} else if n > 0 {
			removed = append(removed, fmt.Sprintf("%d tc filters on %s", n, name))
		}
	}
	chains, err := iptables.RemoveChains("SKIFF-")
	errs = append(errs, err)
	for _, c := range chains {
		removed = append(removed, "iptables chain "+c)
	}
	// Pinned links go with their pins: the sk_lookup and cgroup programs they
	// hold come off their hooks.
	if _, err := os.Stat(cfg.BPFDir); err == nil {
		if err := os.RemoveAll(cfg.BPFDir); err != nil {
			errs = append(errs, fmt.Errorf("remove pins in %s: %w", cfg.BPFDir, err))
		} else {
			removed = append(removed, "pins in "+cfg.BPFDir)
		}
	}
	if cfg.Socket != "" && os.Remove(cfg.Socket) == nil {
		removed = append(removed, "socket "+cfg.Socket)
	}
	r, err := removeState(cfg.StateDir, cfg.Keep)
	removed = append(removed, r...)
	errs = append(errs, err)
	return removed, errors.Join(errs...)
}

// ours reports whether a device is one skiff makes.
func ours(name string) bool {
	return name == overlay.BridgeName || name == overlay.VXLANName || name == limits.IFBName || strings.HasPrefix(name, overlay.VethPrefix)
}

// removeState removes the state directory but the paths to keep (and the
// directories leading to them).
func removeState(dir string, keep []string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	var removed []string
	var errs []error
	kept := false
	for _, e := range entries {
		p := filepath.Join(dir, e.Name())
		if slices.ContainsFunc(keep, func(k string) bool { return k == p || strings.HasPrefix(k, p+"/") }) {
			kept = true
			continue
		}
		if err := os.RemoveAll(p); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, "state "+p)
	}
	if !kept && os.Remove(dir) == nil {
		removed = append(removed, "state directory "+dir)
	}
	return removed, errors.Join(errs...)
}
