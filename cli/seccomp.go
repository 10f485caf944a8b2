package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	"github.com/skiffnet/skiff/sockets/broker/seccomp"
)

// cmdSeccompProfile prints skiff's seccomp profile: a base profile with
// connect() and listen() handed to skiffd's seccomp agent, for runtimes
// (docs/sockets.md, "Unmodified images").
func cmdSeccompProfile(_ context.Context, env Env, args []string) error {
	fs := flags(env, "seccomp-profile")
	base := fs.String("base", "none", `the profile to extend: an OCI or containers JSON file (podman's is /usr/share/containers/seccomp.json), or "none" (allow everything else)`)
	listener := fs.String("listener", seccomp.DefaultListener, `skiffd's --seccomp-socket; "" prints the profile without the notifications`)
	bpf := fs.String("bpf", "", "also write the rules as a classic BPF filter to this file (for skiff-seccomp-exec --filter)")
	if err := parse(fs, args); err != nil {
		return err
	}
	b, err := seccomp.LoadBase(*base)
	if err != nil {
		return err
	}
	p, err := seccomp.Build(b, *listener)
	if err != nil {
		return err
	}
	if *bpf != "" {
		if err := os.WriteFile(*bpf, seccomp.FilterBytes(), 0o644); err != nil {
			return fmt.Errorf("write the filter: %w", err)
		}
	}
	enc := json.NewEncoder(env.Stdout)
	enc.SetIndent("", "\t")
	return enc.Encode(p)
}
