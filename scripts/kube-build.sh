#!/usr/bin/env bash
# Builds skiff-kube (kube/tools: kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy and kubectl in one program) once per
# content: the binary is kept in a cache directory keyed by the hash of
# kube/tools' go.mod, go.sum and source, the Go version and these build
# settings, and a run whose binary is there builds nothing. Then bin/skiff-kube
# in the repository links to it, and the script prints its path.
#
#   SKIFF_KUBE_CACHE  cache directory (default /var/cache/skiff/kube)
#   SKIFF_KUBE_LINK   the link to make (default REPO/bin/skiff-kube; empty: none)
#
# A cold build takes about 5 minutes on 2 cores (docs/design/kubernetes-lab.md).
set -euo pipefail

die() { echo "kube-build: $*" >&2; exit 1; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools=$repo/kube/tools
cache=${SKIFF_KUBE_CACHE:-/var/cache/skiff/kube}
link=${SKIFF_KUBE_LINK-$repo/bin/skiff-kube}

command -v go >/dev/null || die "go is not in PATH"
[ -f "$tools/go.mod" ] && [ -f "$tools/go.sum" ] || die "$tools has no go.mod and go.sum"

# The Kubernetes release is the one go.mod requires: its version goes into
# the binary as upstream's build puts it there (hack/lib/version.sh), for both
# component-base (the components' --version, /version) and client-go.
kversion=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v[0-9]/ { print $2; exit }' "$tools/go.mod")
[[ $kversion =~ ^v([0-9]+)\.([0-9]+)\.[0-9]+$ ]] || die "no k8s.io/kubernetes vX.Y.Z requirement in $tools/go.mod (found '$kversion')"
major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags+=" -X $pkg.gitVersion=$kversion -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
# Upstream's release tags: selinux (go-selinux), notest (no test-only
# code), grpcnotrace (no x/net/trace). Static, as upstream builds all but the
# kubelet; the kubelet needs no cgo on Linux either.
tags=selinux,notest,grpcnotrace
export CGO_ENABLED=0 GOFLAGS=-mod=readonly GOTOOLCHAIN=local

key=$(
	cd "$tools"
	{
		go version
		go env GOOS GOARCH
		echo "$tags $ldflags CGO_ENABLED=$CGO_ENABLED"
		for f in go.mod go.sum $(find . -name '*.go' | LC_ALL=C sort); do
			echo "== $f"
			cat "$f"
		done
	} | sha256sum | cut -c1-16
)
dir=$cache/$key
bin=$dir/skiff-kube

if [ ! -x "$bin" ]; then
	mkdir -p "$dir" || die "cannot create $dir (set SKIFF_KUBE_CACHE)"
	# One build at a time per cache: a second run waits for the first and
	# then finds its binary.
	exec 9>"$cache/.lock"
	flock 9
	if [ ! -x "$bin" ]; then
		echo "kube-build: building skiff-kube (Kubernetes $kversion) into $dir; about 5 minutes cold on 2 cores" >&2
		start=$(date +%s)
		(cd "$tools" && go build -trimpath -buildvcs=false -tags "$tags" -ldflags "$ldflags" -o "$bin.tmp" .) ||
			{ rm -f "$bin.tmp"; die "go build failed in $tools"; }
		"$bin.tmp" kubectl version --client >/dev/null || { rm -f "$bin.tmp"; die "the built binary does not run"; }
		mv -f "$bin.tmp" "$bin"
		echo "kube-build: built in $(($(date +%s) - start))s: $(du -h "$bin" | cut -f1) $bin" >&2
	fi
	exec 9>&-
fi

if [ -n "$link" ]; then
	mkdir -p "$(dirname "$link")"
	ln -sfn "$bin" "$link"
fi
echo "$bin"
