#!/usr/bin/env bash
# Installs everything skiff needs on a fresh Debian 12 machine. Idempotent.
set -euo pipefail

packages=(
	build-essential clang llvm libbpf-dev bpftool        # C, eBPF
	iproute2 iptables iputils-ping netcat-openbsd psmisc # data plane and lab
	iperf3 sockperf memcached libmemcached-tools nginx-light wrk apache2-utils # benchmarks
	python3 curl ca-certificates openssl
	containernetworking-plugins                          # portmap, chained after skiff-cni
	podman runc containerd busybox-static                # real runtimes in the lab tests
)
missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
	echo "installing: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian's nginx, memcached, podman and containerd start as system services on
# install (where systemd runs); skiff's tests run their own instances and need
# none of them.
for svc in nginx memcached podman.socket containerd; do
	systemctl disable --now "$svc" >/dev/null 2>&1 || true
done

go mod download
# Kubernetes (API server, controller manager, kubectl, ...) for the lab's
# Kube tests: built once per kube/tools content, cached across runs
# (about 5 minutes cold; docs/design/kubernetes-lab.md).
./scripts/kube-build.sh
# cnitool: a CNI client nobody here wrote, for the compatibility test.
gobin=$(go env GOPATH)/bin
[ -x "$gobin/cnitool" ] || GOFLAGS=-mod=mod go install github.com/containernetworking/cni/cnitool@v1.3.0
echo "deps ok"
