// Package seccomp is skiff's seccomp agent side of the sockets layer: the
// profile that makes a container runtime hand the container's seccomp
// notifications to skiffd (OCI linux.seccomp.listenerPath), the same rules
// as a classic BPF filter for launchers that install it themselves, and the
// receiver that takes the runtime's notification descriptors.
//
// The rules notify connect() with a 16-byte address (IPv4) and listen():
// the container's broker then swaps in a host socket if the fast path takes
// the connection (docs/sockets.md, "Unmodified images").
package seccomp

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
)

const (
	// DefaultListener is where skiffd takes notification descriptors.
	DefaultListener = "/run/skiff/seccomp.sock"
	// Metadata is the profile's listenerMetadata; the receiver takes
	// descriptors only from profiles that carry it.
	Metadata = "skiff/v1"
	// Tag is set in connect()'s and listen()'s descriptor argument by a
	// process that wants no notification (the preload shim, which serves
	// its sockets itself). The kernel reads an int argument's low 32 bits.
	Tag = 1 << 32
	// maxFD is the largest untagged, non-negative descriptor argument.
	maxFD = 0x7fffffff
	// inet4AddrLen is sizeof(struct sockaddr_in).
	inet4AddrLen = 16
)

// Profile is an OCI runtime-spec LinuxSeccomp object (or podman's
// containers format, a superset), kept as decoded JSON so that fields
// skiff does not know pass through.
type Profile map[string]any

// LoadBase reads a profile to extend. "none" (or "") is a profile that
// allows everything.
func LoadBase(path string) (Profile, error) {
	if path == "" || path == "none" {
		return Profile{"defaultAction": "SCMP_ACT_ALLOW"}, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("seccomp base profile: %w", err)
	}
	var p Profile
	if err := json.Unmarshal(data, &p); err != nil {
		return nil, fmt.Errorf("seccomp base profile %s: %w", path, err)
	}
	if _, ok := p["defaultAction"].(string); !ok {
		return nil, fmt.Errorf("seccomp base profile %s: no defaultAction", path)
	}
	return p, nil
}

// notified are the syscalls skiff's rules take over.
var notified = []string{"connect", "listen"}

// Build returns base with skiff's rules: connect() and listen() of
// untagged descriptors (connect only with an IPv4-sized address) notify
// the listener, every other call of the two is allowed. The base's own
// rules for the two go; a base that already has a listener, or that
// conditions connect or listen on arguments, is refused (skiff's rules
// would change what it means). listener "" leaves the notify rules out
// (to inspect the rest).
func Build(base Profile, listener string) (Profile, error) {
	p := Profile{}
	for k, v := range base {
		p[k] = v
	}
	if lp, _ := p["listenerPath"].(string); lp != "" {
		return nil, fmt.Errorf("the base profile already has a seccomp agent (listenerPath %s)", lp)
	}
	var out []any
	if raw, ok := p["syscalls"]; ok && raw != nil {
		list, ok := raw.([]any)
		if !ok {
			return nil, errors.New("the base profile's syscalls is not a list")
		}
		for _, r := range list {
			rule, ok := r.(map[string]any)
			if !ok {
				return nil, errors.New("the base profile has a syscall rule that is not an object")
			}
			names := names(rule)
			kept := slices.DeleteFunc(slices.Clone(names), func(n string) bool { return slices.Contains(notified, n) })
			if len(kept) == len(names) {
				out = append(out, rule)
				continue
			}
			if args, _ := rule["args"].([]any); len(args) > 0 {
				return nil, fmt.Errorf("the base profile conditions %v on arguments: skiff's rules would change it", names)
			}
			if len(kept) == 0 {
				continue
			}
			c := map[string]any{}
			for k, v := range rule {
				c[k] = v
			}
			c["names"] = kept
			delete(c, "name")
			out = append(out, c)
		}
	}
	for _, r := range Rules() {
		// libseccomp refuses a rule with the default's action
		if (listener == "" && r.Action == actNotify) || r.Action == p["defaultAction"] {
			continue
		}
		out = append(out, r.json())
	}
	p["syscalls"] = out
	if listener != "" {
		p["listenerPath"] = listener
		p["listenerMetadata"] = Metadata
	}
	if _, ok := p["architectures"]; !ok {
		if _, ok := p["archMap"]; !ok {
			p["architectures"] = []string{nativeArch().scmp}
		}
	}
	return p, nil
}

// names returns a rule's syscall names (OCI "names", or the older "name").
func names(rule map[string]any) []string {
	var n []string
	if list, ok := rule["names"].([]any); ok {
		for _, v := range list {
			if s, ok := v.(string); ok {
				n = append(n, s)
			}
		}
	}
	if s, ok := rule["name"].(string); ok {
		n = append(n, s)
	}
	return n
}

// Action names, as the OCI specification spells them.
const (
	actNotify = "SCMP_ACT_NOTIFY"
	actAllow  = "SCMP_ACT_ALLOW"
)

// Comparison operators (OCI).
const (
	opEQ = "SCMP_CMP_EQ"
	opNE = "SCMP_CMP_NE"
	opLE = "SCMP_CMP_LE"
	opGT = "SCMP_CMP_GT"
)

// Arg is one argument condition of a rule: args[Index] Op Value.
type Arg struct {
	Index int
	Op    string
	Value uint64
}

// Rule is one syscall rule: the action when every condition holds.
type Rule struct {
	Name   string
	Action string
	Args   []Arg
}

// Rules is skiff's rule table, from which both the OCI profile and the
// classic BPF filter are made. For each syscall the rules are disjoint
// and together cover every call (libseccomp requires the first, the BPF
// rendering relies on the second).
func Rules() []Rule {
	untagged := Arg{Index: 0, Op: opLE, Value: maxFD}
	return []Rule{
		{Name: "connect", Action: actNotify, Args: []Arg{untagged, {Index: 2, Op: opEQ, Value: inet4AddrLen}}},
		{Name: "connect", Action: actAllow, Args: []Arg{{Index: 0, Op: opGT, Value: maxFD}}},
		{Name: "connect", Action: actAllow, Args: []Arg{untagged, {Index: 2, Op: opNE, Value: inet4AddrLen}}},
		{Name: "listen", Action: actNotify, Args: []Arg{untagged}},
		{Name: "listen", Action: actAllow, Args: []Arg{{Index: 0, Op: opGT, Value: maxFD}}},
	}
}

func (r Rule) json() map[string]any {
	args := make([]any, len(r.Args))
	for i, a := range r.Args {
		args[i] = map[string]any{"index": a.Index, "value": a.Value, "op": a.Op}
	}
	return map[string]any{"names": []string{r.Name}, "action": r.Action, "args": args}
}

// arch is a native architecture the filter knows.
type arch struct {
	goarch  string
	scmp    string // libseccomp's name
	audit   uint32 // AUDIT_ARCH_*
	syscall map[string]uint32
}

var arches = []arch{
	{"amd64", "SCMP_ARCH_X86_64", 0xc000003e, map[string]uint32{"connect": 42, "listen": 50}},
	{"arm64", "SCMP_ARCH_AARCH64", 0xc00000b7, map[string]uint32{"connect": 203, "listen": 201}},
}

func nativeArch() arch {
	for _, a := range arches {
		if a.goarch == runtime.GOARCH {
			return a
		}
	}
	return arches[0]
}
