#!/usr/bin/env bash
# Builds, with no registry, the two images the lab's kubelets need, as
# docker-archive tarballs (manifest.json, config, one layer: what `docker
# save` writes and `ctr images import` reads):
#
#   pause.tar    a static pause (kube/images/pause.c, gcc -static), tagged
#                with each of SKIFF_PAUSE_IMAGES (default registry.k8s.io/pause:3.6,
#                containerd 1.6's CRI sandbox_image, and registry.k8s.io/pause:3.10.1,
#                what kubeadm 1.34 configures)
#   busybox.tar  Debian's busybox-static, /bin/busybox and a link per applet,
#                tagged SKIFF_BUSYBOX_IMAGE (default skiff.dev/busybox:VERSION:
#                not :latest, whose imagePullPolicy defaults to Always and so
#                to a pull from a registry there is none of)
#
# The same inputs give the same bytes. With --import SOCKET it then imports
# both into containerd's k8s.io namespace (the CRI's) at that address.
#
#   kube-images.sh [--import SOCKET] [OUTDIR]   (OUTDIR default: SKIFF_KUBE_CACHE/images)
set -euo pipefail

die() { echo "kube-images: $*" >&2; exit 1; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
import=""
while (($#)); do
	case $1 in
	--import) (($# >= 2)) || die "--import needs containerd's socket"; import=$2; shift 2 ;;
	-h | --help) sed -n '2,/^set -e/{/^set -e/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
	-*) die "unknown flag $1" ;;
	*) break ;;
	esac
done
out=${1:-${SKIFF_KUBE_CACHE:-/var/cache/skiff/kube}/images}
(($# <= 1)) || die "usage: kube-images.sh [--import SOCKET] [OUTDIR]"

for tool in gcc strip tar sha256sum; do
	command -v $tool >/dev/null || die "$tool is missing (apt-get install build-essential)"
done
busybox=/bin/busybox
# Debian's busybox package links glibc dynamically; busybox-static's is the one
# that runs alone in an image.
ldd_out=$(LC_ALL=C ldd "$busybox" 2>&1 || true)
[ -x "$busybox" ] && [[ $ldd_out == *"not a dynamic executable"* ]] ||
	die "$busybox is not a static busybox (apt-get install busybox-static)"
bbversion=$("$busybox" 2>&1 | sed -n '1s/^BusyBox v\([0-9.]*\).*/\1/p')
[ -n "$bbversion" ] || die "cannot read the version of $busybox"

read -r -a pause_tags <<<"${SKIFF_PAUSE_IMAGES:-registry.k8s.io/pause:3.6 registry.k8s.io/pause:3.10.1}"
busybox_tag=${SKIFF_BUSYBOX_IMAGE:-skiff.dev/busybox:$bbversion}
((${#pause_tags[@]})) || die "SKIFF_PAUSE_IMAGES is empty"
arch=$(dpkg --print-architecture 2>/dev/null || go env GOARCH)

work=$(mktemp -d /tmp/kube-images.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# tar_dir DIR FILE: a reproducible tar of DIR's contents, named without ./
# (manifest.json, bin/sh) as docker save names them.
tar_dir() {
	(cd "$1" && find . -mindepth 1 -printf '%P\n' | LC_ALL=C sort) |
		tar --no-recursion --mtime=@0 --owner=0 --group=0 --numeric-owner --format=posix \
			--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime -C "$1" -cf "$2" -T -
}

# json_list A B C: ["A","B","C"] (the arguments need no escaping).
json_list() {
	local s="" a
	for a; do s+="${s:+,}\"$a\""; done
	echo "[$s]"
}

# image NAME ROOTFS CONFIG-JSON TAG...: writes OUT/NAME.tar, a docker-archive
# of one layer (ROOTFS) with CONFIG-JSON as the container config.
image() {
	local name=$1 rootfs=$2 config=$3
	shift 3
	local d=$work/$name.archive
	mkdir -p "$d"
	tar_dir "$rootfs" "$work/$name.layer.tar"
	local diff
	diff=$(sha256sum "$work/$name.layer.tar" | cut -d' ' -f1)
	mkdir -p "$d/$diff"
	mv "$work/$name.layer.tar" "$d/$diff/layer.tar"
	printf '{"architecture":"%s","os":"linux","created":"1970-01-01T00:00:00Z","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created":"1970-01-01T00:00:00Z","created_by":"skiff scripts/kube-images.sh"}]}' \
		"$arch" "$config" "$diff" >"$work/$name.config.json"
	local cfg
	cfg=$(sha256sum "$work/$name.config.json" | cut -d' ' -f1)
	mv "$work/$name.config.json" "$d/$cfg.json"
	printf '[{"Config":"%s.json","RepoTags":%s,"Layers":["%s/layer.tar"]}]' "$cfg" "$(json_list "$@")" "$diff" >"$d/manifest.json"
	tar_dir "$d" "$out/$name.tar.tmp"
	mv -f "$out/$name.tar.tmp" "$out/$name.tar"
	echo "kube-images: $out/$name.tar: $* (sha256:$cfg)" >&2
}

# pause
root=$work/pause.rootfs
mkdir -p "$root"
gcc -static -Os -Wall -Wextra -Werror -o "$root/pause" "$repo/kube/images/pause.c" || die "gcc -static failed (libc6-dev is needed)"
strip "$root/pause"
chmod 0755 "$root/pause"
image pause "$root" '{"Entrypoint":["/pause"],"User":"65535:65535","WorkingDir":"/"}' "${pause_tags[@]}"

# busybox
root=$work/busybox.rootfs
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,root,tmp,proc,sys,dev,var,home}
chmod 1777 "$root/tmp"
chmod 0700 "$root/root"
install -m 0755 "$busybox" "$root/bin/busybox"
while read -r applet; do
	[ "$applet" = bin/busybox ] && continue
	[ -e "$root/$applet" ] || [ -L "$root/$applet" ] || ln -s /bin/busybox "$root/$applet"
done < <("$busybox" --list-full)
[ -L "$root/bin/sh" ] || die "$busybox has no sh applet"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n' >"$root/etc/passwd"
printf 'root:x:0:\nnobody:x:65534:\n' >"$root/etc/group"
image busybox "$root" '{"Cmd":["sh"],"Env":["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],"WorkingDir":"/"}' "$busybox_tag"

if [ -n "$import" ]; then
	command -v ctr >/dev/null || die "ctr is missing (apt-get install containerd)"
	[ -S "$import" ] || die "$import is not a socket (is containerd running there?)"
	for name in pause busybox; do
		ctr --address "$import" -n k8s.io images import "$out/$name.tar" >&2 ||
			die "ctr --address $import -n k8s.io images import $out/$name.tar failed"
	done
fi
echo "$out/pause.tar"
echo "$out/busybox.tar"
