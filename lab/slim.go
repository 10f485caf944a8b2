package lab

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/skiffnet/skiff/slim"
)

// The papers' routers on every host (Config.SlimRouters): package slim.

// SlimSocket is where host's router of design listens.
func (l *Lab) SlimSocket(host, design string) string {
	return filepath.Join(l.hostDir(host), design+".sock")
}

// startSlimRouters starts host's Slim and SlimFast routers, in its
// namespace, and waits for their sockets. Down stops them with every
// other process of the lab's namespaces.
func (l *Lab) startSlimRouters(ctx context.Context, h Host) error {
	if !l.Config.SlimRouters {
		return nil
	}
	for _, d := range []string{slim.DesignSlim, slim.DesignSlimFast} {
		sock := l.SlimSocket(h.Name, d)
		os.Remove(sock)
		if _, err := l.spawn(h.Netns, filepath.Join(l.hostDir(h.Name), d+"-router.log"), filepath.Join(l.Config.BinDir, "skiff"),
			"slim-router", "--design", d, "--socket", sock, "--agent-socket", h.Socket); err != nil {
			return fmt.Errorf("start the %s router on %s: %w", d, h.Name, err)
		}
	}
	deadline := time.Now().Add(15 * time.Second)
	for _, d := range []string{slim.DesignSlim, slim.DesignSlimFast} {
		for {
			c, err := net.Dial("unixpacket", l.SlimSocket(h.Name, d))
			if err == nil {
				c.Close()
				break
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return fmt.Errorf("the %s router on %s never listened (%s)", d, h.Name, filepath.Join(l.hostDir(h.Name), d+"-router.log"))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

// slimEnv gives a container's command what libslim.so reads (the bench's
// modes preload it and pick the design).
func (l *Lab) slimEnv(cmd *exec.Cmd, c *Container) {
	if !l.Config.SlimRouters || c == nil {
		return
	}
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, "SLIM_ROUTER_DIR="+l.hostDir(c.Host), "SLIM_CIDR="+l.Config.ClusterCIDR,
		"SLIM_LIB="+filepath.Join(l.Config.BinDir, "libslim.so"))
}

// ListeningUDP returns a container's UDP sockets that are host sockets
// (a SlimFast server's: none in its own namespace).
func (l *Lab) ListeningUDP(_ context.Context, target string) ([]netip.AddrPort, error) {
	if !l.Config.SlimRouters || !strings.Contains(target, "/") {
		return nil, nil
	}
	c, err := l.Container(target)
	if err != nil {
		return nil, err
	}
	return l.slimListeners(c, slim.FlagUDP)
}

// slimListeners are the addresses of c that listen through the SlimFast
// router (they have no listening socket of their own); flags: slim.FlagUDP
// for its UDP sockets.
func (l *Lab) slimListeners(c *Container, flags uint16) ([]netip.AddrPort, error) {
	conn, err := net.Dial("unixpacket", l.SlimSocket(c.Host, slim.DesignSlimFast))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := conn.Write(slim.Req{Op: slim.OpList, Flags: flags}.Encode()); err != nil {
		return nil, err
	}
	b := make([]byte, 1<<16)
	n, err := conn.Read(b)
	if err != nil {
		return nil, err
	}
	rsp, err := slim.DecodeRsp(b[:n])
	if err != nil {
		return nil, err
	}
	var out []netip.AddrPort
	for _, ap := range rsp.List {
		if ap.Addr() == c.IP {
			out = append(out, ap)
		}
	}
	return out, nil
}
