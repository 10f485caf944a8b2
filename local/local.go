// Package local keeps one host's own records in files: its endpoints (the
// attachment of each container: veth, namespace, MAC, limit) and the leases
// of its subnet's addresses. It is the private half of a source whose
// cluster-wide truth lives elsewhere (Kubernetes: the Node's podCIDR and
// the pods), where the etcd store would keep them under the host's keys.
//
// Files are written whole (temporary file, then rename) and an address is
// leased by creating its file exclusively, so an agent that dies at any
// point leaves either the old record or the new one; a lease whose endpoint
// was never written is given back when the store is next opened.
package local

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/skiffnet/skiff/cluster"
	"github.com/skiffnet/skiff/source"
)

// Store is one host's records under a directory.
type Store struct {
	dir  string
	host string
	mu   sync.Mutex // one change at a time
}

// Open opens (creating) the records of host under dir, gives back the
// leases no endpoint holds (an allocation or release cut short) and
// leases again the addresses of endpoints whose lease is missing. It
// reports what it gave back.
func Open(dir, host string) (*Store, []netip.Addr, error) {
	s := &Store{dir: dir, host: host}
	for _, d := range []string{s.endpointDir(), s.leaseDir()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, nil, fmt.Errorf("local store: %w", err)
		}
	}
	eps, err := s.endpoints()
	if err != nil {
		return nil, nil, err
	}
	held := map[netip.Addr]string{}
	for _, e := range eps {
		held[e.IP.Addr()] = key(e.ContainerID, e.IfName)
	}
	leases, err := os.ReadDir(s.leaseDir())
	if err != nil {
		return nil, nil, fmt.Errorf("local store: %w", err)
	}
	var freed []netip.Addr
	for _, l := range leases {
		a, err := netip.ParseAddr(l.Name())
		if err != nil {
			continue // last, or a temporary file
		}
		owner, _ := os.ReadFile(filepath.Join(s.leaseDir(), l.Name()))
		if o := string(owner); o == "" || held[a] != o {
			if err := os.Remove(filepath.Join(s.leaseDir(), l.Name())); err != nil {
				return nil, nil, fmt.Errorf("local store: %w", err)
			}
			freed = append(freed, a)
			continue
		}
		delete(held, a)
	}
	// An endpoint whose lease is gone (removed by hand) takes it again,
	// so that its address is not given twice.
	for a, owner := range held {
		if err := s.lease(a, owner); err != nil {
			return nil, nil, fmt.Errorf("endpoint %s holds %s, leased to another: %w", owner, a, err)
		}
	}
	return s, freed, nil
}

func (s *Store) endpointDir() string { return filepath.Join(s.dir, "endpoints") }
func (s *Store) leaseDir() string    { return filepath.Join(s.dir, "leases") }

// key names an endpoint among the host's: its container and interface,
// escaped into one file name.
func key(containerID, ifName string) string {
	return url.PathEscape(containerID) + "@" + url.PathEscape(ifName)
}

func (s *Store) endpointFile(containerID, ifName string) string {
	return filepath.Join(s.endpointDir(), key(containerID, ifName)+".json")
}

// Endpoints are the host's endpoints (another host's: none are kept here).
func (s *Store) Endpoints(host string) ([]cluster.Endpoint, error) {
	if host != "" && host != s.host {
		return nil, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.endpoints()
}

func (s *Store) endpoints() ([]cluster.Endpoint, error) {
	files, err := os.ReadDir(s.endpointDir())
	if err != nil {
		return nil, fmt.Errorf("local store: %w", err)
	}
	var out []cluster.Endpoint
	for _, f := range files {
		if !strings.HasSuffix(f.Name(), ".json") {
			continue // a temporary file
		}
		e, err := readEndpoint(filepath.Join(s.endpointDir(), f.Name()))
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

func readEndpoint(path string) (cluster.Endpoint, error) {
	var e cluster.Endpoint
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return e, fmt.Errorf("endpoint %s: %w", filepath.Base(path), source.ErrNotFound)
	}
	if err != nil {
		return e, fmt.Errorf("local store: %w", err)
	}
	if err := json.Unmarshal(b, &e); err != nil {
		return e, fmt.Errorf("local store: %s: %w", path, err)
	}
	return e, nil
}

// Endpoint is one of the host's endpoints (source.ErrNotFound).
func (s *Store) Endpoint(host, containerID, ifName string) (cluster.Endpoint, error) {
	if host != s.host {
		return cluster.Endpoint{}, fmt.Errorf("endpoint of host %s: %w", host, source.ErrNotFound)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return readEndpoint(s.endpointFile(containerID, ifName))
}

// PutEndpoint overwrites an endpoint Allocate recorded.
func (s *Store) PutEndpoint(e cluster.Endpoint) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	path := s.endpointFile(e.ContainerID, e.IfName)
	if _, err := os.Stat(path); e.Host != s.host || errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("endpoint %s/%s/%s: %w", e.Host, e.ContainerID, e.IfName, source.ErrNotFound)
	}
	return writeJSON(path, e)
}

// Allocate gives e an address of subnet and records it: e.IP's address
// when set (one of the subnet's container addresses, and free), else the
// next free one after the last given. Asking again for an endpoint that
// exists returns it.
func (s *Store) Allocate(subnet netip.Prefix, e cluster.Endpoint) (cluster.Endpoint, error) {
	if e.Host != s.host {
		return cluster.Endpoint{}, fmt.Errorf("allocate for host %s on %s: %w", e.Host, s.host, source.ErrNotInSubnet)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	want := e.IP.Addr()
	addrs := cluster.ContainerAddrs(subnet)
	if want.IsValid() && !subnet.Contains(want) || want.IsValid() && (want.Less(addrs[0]) || addrs[len(addrs)-1].Less(want)) {
		return cluster.Endpoint{}, fmt.Errorf("%s: %w %s (containers here get %s to %s)", want, source.ErrNotInSubnet, subnet, addrs[0], addrs[len(addrs)-1])
	}
	path := s.endpointFile(e.ContainerID, e.IfName)
	if existing, err := readEndpoint(path); err == nil {
		if want.IsValid() && existing.IP.Addr() != want {
			return cluster.Endpoint{}, fmt.Errorf("container %s has %s already, not %s: %w", e.ContainerID, existing.IP.Addr(), want, source.ErrInUse)
		}
		return existing, nil
	} else if !errors.Is(err, source.ErrNotFound) {
		return cluster.Endpoint{}, err
	}
	owner := key(e.ContainerID, e.IfName)
	candidates := []netip.Addr{want}
	if !want.IsValid() {
		candidates = s.roundRobin(addrs)
	}
	for _, a := range candidates {
		err := s.lease(a, owner)
		if errors.Is(err, fs.ErrExist) {
			if want.IsValid() {
				by, _ := os.ReadFile(filepath.Join(s.leaseDir(), a.String()))
				return cluster.Endpoint{}, fmt.Errorf("%s: %w (by %s)", a, source.ErrInUse, by)
			}
			continue
		}
		if err != nil {
			return cluster.Endpoint{}, err
		}
		e.IP = netip.PrefixFrom(a, subnet.Bits())
		if err := writeJSON(path, e); err != nil {
			os.Remove(filepath.Join(s.leaseDir(), a.String()))
			return cluster.Endpoint{}, err
		}
		if !want.IsValid() {
			writeFile(filepath.Join(s.leaseDir(), "last"), []byte(a.String())) // a hint only
		}
		return e, nil
	}
	return cluster.Endpoint{}, fmt.Errorf("subnet %s is full: %w", subnet, source.ErrExhausted)
}

// roundRobin orders addrs to start after the last address given.
func (s *Store) roundRobin(addrs []netip.Addr) []netip.Addr {
	b, _ := os.ReadFile(filepath.Join(s.leaseDir(), "last"))
	last, _ := netip.ParseAddr(string(b))
	for i, a := range addrs {
		if a == last {
			return append(addrs[i+1:len(addrs):len(addrs)], addrs[:i+1]...)
		}
	}
	return addrs
}

// lease takes address a for owner: fs.ErrExist when it is taken.
func (s *Store) lease(a netip.Addr, owner string) error {
	f, err := os.OpenFile(filepath.Join(s.leaseDir(), a.String()), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return err
		}
		return fmt.Errorf("local store: %w", err)
	}
	_, err = f.WriteString(owner)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("local store: %w", err)
	}
	return nil
}

// Release forgets e and frees its address if the lease is still e's.
// Releasing an endpoint that is not there is not an error.
func (s *Store) Release(e cluster.Endpoint) error {
	if e.Host != s.host {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := os.Remove(s.endpointFile(e.ContainerID, e.IfName)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("local store: %w", err)
	}
	if !e.IP.IsValid() {
		return nil
	}
	lease := filepath.Join(s.leaseDir(), e.IP.Addr().String())
	if owner, err := os.ReadFile(lease); err == nil && string(owner) == key(e.ContainerID, e.IfName) {
		if err := os.Remove(lease); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("local store: %w", err)
		}
	}
	return nil
}

func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("local store: %w", err)
	}
	return writeFile(path, b)
}

// writeFile replaces path's content whole.
func writeFile(path string, b []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("local store: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("local store: %w", err)
	}
	return nil
}
