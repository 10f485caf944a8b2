package layer

import (
	"fmt"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
)

// Helpers for layers' probes (Registration.Probe): each check says, in a
// user's words, what the kernel lacks; First runs them in order.

// A Check is one thing a probe checks: nil when the host has it.
type Check func() error

// Programs checks that the kernel loads programs of type pt that call
// helpers.
func Programs(pt ebpf.ProgramType, helpers ...asm.BuiltinFunc) Check {
	return func() error { return programs(pt, helpers...) }
}

func programs(pt ebpf.ProgramType, helpers ...asm.BuiltinFunc) error {
	if err := features.HaveProgramType(pt); err != nil {
		return fmt.Errorf("the kernel has no %s eBPF programs: %w", pt, err)
	}
	for _, h := range helpers {
		if err := features.HaveProgramHelper(pt, h); err != nil {
			return fmt.Errorf("the kernel's %s eBPF programs cannot call %s: %w", pt, h, err)
		}
	}
	return nil
}

// Maps checks that the kernel has maps of types.
func Maps(types ...ebpf.MapType) Check {
	return func() error { return maps(types...) }
}

func maps(types ...ebpf.MapType) error {
	for _, mt := range types {
		if err := features.HaveMapType(mt); err != nil {
			return fmt.Errorf("the kernel has no %s eBPF maps: %w", mt, err)
		}
	}
	return nil
}

var kernelBTF = sync.OnceValues(btf.LoadKernelSpec)

// KernelHas checks that the kernel's BTF (/sys/kernel/btf/vmlinux) has a
// function (a kfunc, or one whose presence stands for a feature) for each
// name; what says what the name stands for.
func KernelHas(what string, names ...string) Check {
	return func() error { return kernelHas(what, names...) }
}

func kernelHas(what string, names ...string) error {
	spec, err := kernelBTF()
	if err != nil {
		return fmt.Errorf("%s: the kernel's BTF cannot be read: %w", what, err)
	}
	var missing []string
	for _, n := range names {
		var fn *btf.Func
		if err := spec.TypeByName(n, &fn); err != nil {
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("the kernel lacks %s (%s)", what, strings.Join(missing, ", "))
	}
	return nil
}

// First runs checks in order and returns the first failure: a probe
// reports one reason, and checks after a failed one (which may change the
// host: mounting cgroup v2) do not run.
func First(checks ...Check) error {
	for _, c := range checks {
		if err := c(); err != nil {
			return err
		}
	}
	return nil
}
