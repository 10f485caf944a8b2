package cluster

import (
	"bytes"
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"strings"
)

// MaxContainerIDLen bounds a container ID. The CNI spec and libcni set no
// limit; runtimes use 64 hex digits (containerd, CRI-O, Docker, Podman). The
// ID names files in the agent's state directory (a broker's "<id>.stats",
// under NAME_MAX, 255) and keys in etcd, so an unbounded one fails far from
// where it came in.
const MaxContainerIDLen = 128

// containerIDPattern is libcni's (pkg/utils, cniValidNameChars): it admits
// no '/', and no ID that is "." or "..".
var containerIDPattern = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`)

// ValidateContainerID checks a container ID as libcni does, and its length.
func ValidateContainerID(id string) error {
	switch {
	case id == "":
		return fmt.Errorf("container ID is empty")
	case len(id) > MaxContainerIDLen:
		return fmt.Errorf("container ID is %d characters long, more than %d", len(id), MaxContainerIDLen)
	case !containerIDPattern.MatchString(id):
		return fmt.Errorf("container ID %q has characters outside [a-zA-Z0-9_.-] or does not start with a letter or digit", id)
	}
	return nil
}

// ValidateIfName checks an interface name as libcni does (the kernel's
// dev_valid_name): 1-15 bytes, not "." or "..", no '/', ':' or white space.
func ValidateIfName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("interface name is empty")
	case len(name) > 15:
		return fmt.Errorf("interface name %q is longer than 15 characters", name)
	case name == "." || name == "..":
		return fmt.Errorf("interface name %q is not a valid Linux interface name", name)
	case strings.ContainsAny(name, "/: \t\n\v\f\r\x00"):
		return fmt.Errorf("interface name %q has '/', ':' or white space", name)
	}
	return nil
}

// ValidateNetns checks a network namespace path: absolute, clean (no ".."
// or "." elements, no double slashes), at most PATH_MAX.
func ValidateNetns(path string) error {
	switch {
	case !filepath.IsAbs(path):
		return fmt.Errorf("network namespace %q is not an absolute path", path)
	case len(path) > 4095:
		return fmt.Errorf("network namespace path is %d characters long, more than 4095", len(path))
	case filepath.Clean(path) != path || strings.ContainsRune(path, 0):
		return fmt.Errorf("network namespace path %q is not clean", path)
	}
	return nil
}

// ParseMAC reads a MAC address a runtime asks for: a unicast, non-zero
// Ethernet address.
func ParseMAC(s string) (net.HardwareAddr, error) {
	hw, err := net.ParseMAC(s)
	if err != nil || len(hw) != 6 || hw[0]&1 != 0 || bytes.Equal(hw, make([]byte, 6)) {
		return nil, fmt.Errorf("MAC %q: want a unicast Ethernet address such as 02:42:0a:f4:00:07", s)
	}
	return hw, nil
}

// ValidateCgroup checks a container's cgroup as a runtime passes it (CNI
// cgroupPath; "" is none): a path, relative to the cgroup v2 mount or on
// it, or what a systemd cgroup driver names. It must name a cgroup below
// the root: "/", "." or "-.slice" would put the sockets layer's hooks on
// every process of the host, and ".." could climb anywhere.
func ValidateCgroup(p string) error {
	switch {
	case p == "":
		return nil
	case len(p) > 4095 || strings.ContainsRune(p, 0):
		return fmt.Errorf("cgroup %.64q: too long, or holds a NUL", p)
	case p == "-.slice" || strings.HasPrefix(p, "-.slice:"):
		return fmt.Errorf("cgroup %q is the root: a container's cgroup is below it", p)
	}
	for _, part := range strings.FieldsFunc(p, func(r rune) bool { return r == '/' || r == ':' }) {
		if part == ".." {
			return fmt.Errorf("cgroup %q climbs with \"..\"", p)
		}
	}
	if c := filepath.Clean("/" + p); c == "/" {
		return fmt.Errorf("cgroup %q is the root: a container's cgroup is below it", p)
	}
	return nil
}
