package bench

import (
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strings"
)

// HostMode is the name of the baseline mode every other mode is compared to.
const HostMode = "host"

// Endpoints names the lab targets the server and the client of one cell run in.
type Endpoints struct {
	Server string
	Client string
}

// Placement says where a mode's server and client run.
type Placement struct {
	CrossHost Endpoints // default: server and client on different hosts
	SameHost  Endpoints // Options.SameHost: both on one host
}

// Mode is one data-plane configuration measured by the benchmark.
//
// Adding a mode is a local change: add an entry to Modes, e.g. the
// sockets lab's containers with the shim switched off (the overlay path to
// replaced listeners):
//
//	Modes["sockets-off"] = Mode{
//		Name:      "sockets-off",
//		LabMode:   "sockets",
//		Placement: ContainerPlacement,
//		Wrap:      func(cmd *exec.Cmd) { SetEnv(cmd, "SKIFF_SOCKETS", "off") },
//	}
type Mode struct {
	Name string
	// LabMode is the lab data-plane mode this mode needs (Lab.Mode());
	// empty means the mode runs on any lab (host mode uses the underlay only).
	LabMode string
	// LabArgs are extra skiffd flags of the mode's lab, a variant of
	// LabMode named LabVariant (the cache's rewriting tunnel: "cache" with
	// --cache-tunnel rewrite, variant "rw"): modes of one variant share a lab.
	LabArgs    []string
	LabVariant string
	// LabSlim: the mode's lab runs the Slim and SlimFast routers
	// (lab.Config.SlimRouters), a variant too.
	LabSlim bool
	// Placement gives the server and client targets.
	Placement Placement
	// Wrap, when set, adjusts every server and client command of the mode
	// before it starts (typically environment changes such as LD_PRELOAD).
	Wrap func(cmd *exec.Cmd)
	// Seccomp runs the mode's commands without the shim, under skiff's
	// seccomp filter (the lab must be a SeccompLab).
	Seccomp bool
	// Description is a one-line explanation for help texts.
	Description string
	// Explicit modes run only when asked for by name, never by default.
	Explicit bool
}

// ContainerPlacement is the placement of every container-to-container mode.
var ContainerPlacement = Placement{
	CrossHost: Endpoints{Server: "h1/c1", Client: "h2/c1"},
	SameHost:  Endpoints{Server: "h1/c1", Client: "h1/c2"},
}

// HostPlacement runs server and client in the lab's host namespaces.
var HostPlacement = Placement{
	CrossHost: Endpoints{Server: "h1", Client: "h2"},
	SameHost:  Endpoints{Server: "h1", Client: "h1"},
}

// Modes is the registry of benchmark modes by name.
var Modes = map[string]Mode{
	HostMode: {
		Name:        HostMode,
		Placement:   HostPlacement,
		Description: "lab host namespaces over underlay addresses (the ceiling)",
	},
	// What the sockets layer costs the host's own connections, in the same
	// run as host on hosts without it (host runs in another lab then, see
	// cli's labModesFor).
	"host-sockets": {
		Name:        "host-sockets",
		LabMode:     "sockets",
		Placement:   HostPlacement,
		Description: "lab host namespaces of a sockets lab (what the layer costs the host's own connections)",
		Explicit:    true,
	},
	"overlay": {
		Name:        "overlay",
		LabMode:     "overlay",
		Placement:   ContainerPlacement,
		Description: "containers on the standard VXLAN overlay",
	},
	"cache": {
		Name:        "cache",
		LabMode:     "cache",
		Placement:   ContainerPlacement,
		Description: "containers on the overlay with the ONCache eBPF fast path",
	},
	// The cache with ONCache's rewriting tunnel in place of VXLAN.
	"cache-rewrite": {
		Name:        "cache-rewrite",
		LabMode:     "cache",
		LabArgs:     []string{"--cache-tunnel", "rewrite"},
		LabVariant:  "rw",
		Placement:   ContainerPlacement,
		Description: "the cache with ONCache's rewriting tunnel (--cache-tunnel rewrite): no VXLAN headers",
		Explicit:    true,
	},
	// The papers' own designs of TCP through host sockets (package slim,
	// docs/design/slim.md), on an overlay lab with their routers: UDP
	// stays on the overlay, as in both papers' prototypes.
	"slim": {
		Name:        "slim",
		LabMode:     "overlay",
		LabVariant:  "slim",
		LabSlim:     true,
		Placement:   ContainerPlacement,
		Wrap:        slimWrap("slim"),
		Description: "Slim (NSDI '19) as published: preloaded shim, a user-space router per host, the server's host address sent over an overlay connection, host sockets by SCM_RIGHTS; UDP on the overlay",
		Explicit:    true,
	},
	"slimfast": {
		Name:        "slimfast",
		LabMode:     "overlay",
		LabVariant:  "slim",
		LabSlim:     true,
		Placement:   ContainerPlacement,
		Wrap:        slimWrap("slimfast"),
		Description: "SlimFast (TCC '23) as published: the server's overlay address registered with its router, the client's router connects to the server host's router port with a header naming it; UDP through host sockets, a flow's first datagrams through the server host's relay with a tag",
		Explicit:    true,
	},
	"auto-plain-rewrite": {
		Name:        "auto-plain-rewrite",
		LabMode:     "auto",
		LabArgs:     []string{"--cache-tunnel", "rewrite"},
		LabVariant:  "rw",
		Placement:   ContainerPlacement,
		Wrap:        func(cmd *exec.Cmd) { UnsetEnv(cmd, "LD_PRELOAD") },
		Description: "auto-plain with the cache's rewriting tunnel",
		Explicit:    true,
	},
	// Every layer at once: TCP between preloaded processes on host
	// sockets, the rest on the cache (lab.Command preloads the shim).
	"auto": {
		Name:        "auto",
		LabMode:     "auto",
		Placement:   ContainerPlacement,
		Description: "containers with every layer on (--mode auto): host sockets for TCP, the cache for the rest",
	},
	// What a user with an image as it comes gets from auto: the same lab,
	// programs run as an unmodified image runs them (no preload, no
	// seccomp profile): TCP takes the cache across hosts.
	"auto-plain": {
		Name:        "auto-plain",
		LabMode:     "auto",
		Placement:   ContainerPlacement,
		Wrap:        func(cmd *exec.Cmd) { UnsetEnv(cmd, "LD_PRELOAD") },
		Description: "auto as an unmodified image runs in it: no preload, no seccomp profile",
	},
	// auto with programs under skiff's seccomp profile, no preload: what
	// an unmodified image gets where the runtime is given the profile.
	"auto-seccomp": {
		Name:        "auto-seccomp",
		LabMode:     "auto",
		Placement:   ContainerPlacement,
		Seccomp:     true,
		Description: "auto with programs under skiff's seccomp profile (no preload: unmodified images)",
		Explicit:    true,
	},
	// Same-host fast channels (asked for by name, with --same-host: across
	// hosts it is the overlay).
	"channels": {
		Name:        "channels",
		LabMode:     "channels",
		Placement:   ContainerPlacement,
		Description: "containers of one host on fast channels (sk_msg socket to socket); with --same-host",
		Explicit:    true,
	},
	// One overlay flow's receive stages over the CPUs (asked for by name).
	"steering": {
		Name:        "steering",
		LabMode:     "steering",
		Placement:   ContainerPlacement,
		Description: "containers on the overlay with each receive stage of a flow on its own CPU (Falcon)",
		Explicit:    true,
	},
	// The lab runs a sockets-mode container's commands with the shim
	// preloaded (lab.Command), so the mode needs no Wrap of its own.
	"sockets": {
		Name:        "sockets",
		LabMode:     "sockets",
		Placement:   ContainerPlacement,
		Description: "containers' TCP on host sockets (Slim-style shim, eBPF connection setup)",
	},
	// The same containers' TCP on host sockets without the shim: the
	// broker's seccomp agent swaps them in at connect and listen, as for
	// static and Go binaries of unmodified images (asked for by name).
	"sockets-seccomp": {
		Name:        "sockets-seccomp",
		LabMode:     "sockets",
		Placement:   ContainerPlacement,
		Seccomp:     true,
		Description: "containers' TCP on host sockets through the seccomp agent (no preload: unmodified images)",
		Explicit:    true,
	},
}

// Lab names the lab the mode runs in: its lab mode and variant.
func (m Mode) Lab() string { return m.LabMode + m.LabVariant }

// Endpoints returns the server and client targets for the placement asked for.
func (m Mode) Endpoints(sameHost bool) Endpoints {
	if sameHost {
		return m.Placement.SameHost
	}
	return m.Placement.CrossHost
}

// Fits reports whether the mode can be measured on a lab brought up in labMode.
//
// A lab that carries several data-plane modes at once (several lab
// clusters side by side, so that all modes are measured in one run) reports
// them joined by "+", e.g. "overlay+cache", and takes targets qualified by
// the mode: "cache:h1/c1".
func (m Mode) Fits(labMode string) bool {
	if m.LabMode == "" {
		return true
	}
	for _, lm := range strings.Split(labMode, "+") {
		if lm == m.Lab() {
			return true
		}
	}
	return false
}

// targets returns m's endpoints, qualified by its lab mode when the lab
// carries several.
func (m Mode) targets(sameHost bool, labMode string) Endpoints {
	e := m.Endpoints(sameHost)
	if m.LabMode != "" && strings.Contains(labMode, "+") {
		e.Server, e.Client = m.Lab()+":"+e.Server, m.Lab()+":"+e.Client
	}
	return e
}

// SetEnv sets key=value in cmd's environment, starting from the current
// process environment when cmd has none of its own. Meant for Mode.Wrap.
func SetEnv(cmd *exec.Cmd, key, value string) {
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	prefix := key + "="
	env := cmd.Env[:0:0]
	for _, kv := range cmd.Env {
		if !strings.HasPrefix(kv, prefix) {
			env = append(env, kv)
		}
	}
	cmd.Env = append(env, prefix+value)
}

// UnsetEnv removes key from cmd's environment (starting from the current
// process environment when cmd has none of its own). Meant for Mode.Wrap.
func UnsetEnv(cmd *exec.Cmd, key string) {
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = slices.DeleteFunc(slices.Clone(cmd.Env), func(kv string) bool { return strings.HasPrefix(kv, key+"=") })
}

// slimWrap preloads libslim.so (its path from the lab: SLIM_LIB) with
// design; a router that does not answer fails the call (SLIM_STRICT), so
// that overlay figures never pass for the design's.
func slimWrap(design string) func(*exec.Cmd) {
	return func(cmd *exec.Cmd) {
		lib := ""
		for _, kv := range cmd.Env {
			if v, ok := strings.CutPrefix(kv, "SLIM_LIB="); ok {
				lib = v
			}
		}
		SetEnv(cmd, "SLIM_DESIGN", design)
		SetEnv(cmd, "SLIM_STRICT", "1")
		SetEnv(cmd, "LD_PRELOAD", lib)
	}
}

// ModeNames returns the registered mode names, host first, the rest sorted.
func ModeNames() []string {
	names := make([]string, 0, len(Modes))
	for name := range Modes {
		if name != HostMode {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	if _, ok := Modes[HostMode]; ok {
		names = append([]string{HostMode}, names...)
	}
	return names
}

// resolveModes checks the requested modes against the registry and the lab.
// With none requested it picks host plus every mode made for the lab's mode
// but the explicit ones.
// The result is deduplicated, host first, otherwise in the order asked.
func resolveModes(requested []string, labMode string) ([]Mode, error) {
	if len(requested) == 0 {
		for _, name := range ModeNames() {
			if m := Modes[name]; name == HostMode || m.LabMode != "" && !m.Explicit && m.Fits(labMode) {
				requested = append(requested, name)
			}
		}
	}
	var modes []Mode
	seen := map[string]bool{}
	for _, name := range requested {
		m, ok := Modes[name]
		if !ok {
			return nil, fmt.Errorf("unknown mode %q (valid: %s)", name, strings.Join(ModeNames(), ", "))
		}
		if !m.Fits(labMode) {
			return nil, fmt.Errorf("mode %q needs a lab in %q mode, but the lab is in %q mode", name, m.Lab(), labMode)
		}
		if seen[name] {
			continue
		}
		seen[name] = true
		if name == HostMode {
			modes = append([]Mode{m}, modes...)
		} else {
			modes = append(modes, m)
		}
	}
	return modes, nil
}
