// Command skiff-cni is skiff's CNI plugin.
package main

import (
	"runtime"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/skiffnet/skiff/cni"
	"github.com/skiffnet/skiff/version"
)

// A CNI plugin may switch network namespaces; keep main on one OS thread.
func init() { runtime.LockOSThread() }

func main() {
	skel.PluginMainFuncs(cni.Funcs, cni.SpecVersions, "skiff-cni "+version.String())
}
