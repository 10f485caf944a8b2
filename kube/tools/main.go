// Command skiff-kube is the Kubernetes components skiff's lab runs, linked
// into one program so that one build (scripts/kube-build.sh) serves them
// all: Go links their shared code once.
//
//	skiff-kube apiserver ...           kube-apiserver
//	skiff-kube controller-manager ...  kube-controller-manager
//	skiff-kube scheduler ...           kube-scheduler
//	skiff-kube kubelet ...             kubelet
//	skiff-kube proxy ...               kube-proxy
//	skiff-kube kubectl ...             kubectl
//
// Called through a link named after a component (kube-apiserver, kubelet,
// kubectl, ...), it is that component. Each runs as its upstream main does,
// with the rest of the arguments.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	_ "time/tzdata" // CronJob time zones (kube-apiserver, kube-controller-manager)

	_ "k8s.io/client-go/plugin/pkg/client/auth" // kubectl's credential plugins
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"          // --logging-format=json
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go's metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // the version metric
	"k8s.io/component-base/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

// components maps a subcommand to the upstream program it is and its main.
var components = map[string]struct {
	program string
	main    func() int
}{
	"apiserver":          {"kube-apiserver", func() int { return cli.Run(apiserver.NewAPIServerCommand()) }},
	"controller-manager": {"kube-controller-manager", func() int { return cli.Run(controllermanager.NewControllerManagerCommand()) }},
	"scheduler":          {"kube-scheduler", func() int { return cli.Run(scheduler.NewSchedulerCommand()) }},
	"kubelet":            {"kubelet", func() int { return cli.Run(kubelet.NewKubeletCommand(context.Background())) }},
	"proxy":              {"kube-proxy", func() int { return cli.Run(proxy.NewProxyCommand()) }},
	"kubectl":            {"kubectl", runKubectl},
}

// runKubectl is cmd/kubectl's main.
func runKubectl() int {
	logs.GlogSetter(kubectl.GetLogVerbosity(os.Args)) // nolint:errcheck
	if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
		kubectlutil.CheckErr(err) // exits
	}
	return 0
}

// lookup finds the component a name (a subcommand, or the program's own
// name: kube-apiserver, kubelet, ...) stands for.
func lookup(name string) (string, bool) {
	for sub, c := range components {
		if name == sub || name == c.program {
			return sub, true
		}
	}
	return "", false
}

func usage() {
	fmt.Fprintf(os.Stderr, "usage: skiff-kube COMPONENT [ARGS...]  (Kubernetes %s)\n\ncomponents:\n", version.Get().GitVersion)
	for _, sub := range sorted() {
		fmt.Fprintf(os.Stderr, "  %-20s %s\n", sub, components[sub].program)
	}
	fmt.Fprintln(os.Stderr, "\nor run it through a link named after the program (kube-apiserver, kubelet, ...)")
}

func main() {
	sub, ok := lookup(filepath.Base(os.Args[0]))
	args := os.Args[1:]
	if !ok {
		if len(args) == 0 {
			usage()
			os.Exit(2)
		}
		switch args[0] {
		case "-h", "--help", "help":
			usage()
			os.Exit(0)
		case "version", "--version":
			fmt.Println(version.Get().GitVersion)
			os.Exit(0)
		}
		if sub, ok = lookup(args[0]); !ok {
			fmt.Fprintf(os.Stderr, "skiff-kube: unknown component %q (want one of %s)\n\n", args[0], strings.Join(sorted(), ", "))
			usage()
			os.Exit(2)
		}
		args = args[1:]
	}
	// The components read os.Args themselves (cobra's Execute, kubectl's
	// plugin lookup and log verbosity): they see their own program name
	// and their arguments alone, as from their own binary.
	c := components[sub]
	os.Args = append([]string{c.program}, args...)
	os.Exit(c.main())
}

func sorted() []string {
	names := make([]string, 0, len(components))
	for sub := range components {
		names = append(names, sub)
	}
	sort.Strings(names)
	return names
}
