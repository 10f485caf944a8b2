#!/usr/bin/env bash
# make install-check: install into a scratch DESTDIR and check the result,
# then uninstall. Needs no root and changes nothing outside the scratch dir.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=$(mktemp -d)
trap 'rm -rf "$dest"' EXIT
fail() { echo "install-check: $*" >&2; exit 1; }
make -s install DESTDIR="$dest" PREFIX=/usr >/dev/null
for f in usr/bin/skiff usr/bin/skiffd usr/bin/skiff-broker usr/bin/skiff-seccomp-exec usr/lib/skiff/libskiff.so \
	opt/cni/bin/skiff-cni etc/cni/net.d/10-skiff.conflist etc/systemd/system/skiffd.service etc/skiff/skiffd.conf \
	usr/share/doc/skiff/install.md; do
	[ -e "$dest/$f" ] || fail "$f not installed"
done
want=$(printf '%s\n' /usr/bin/skiff /usr/bin/skiffd /usr/bin/skiff-broker /usr/bin/skiff-seccomp-exec \
	/usr/lib/skiff/libskiff.so /opt/cni/bin/skiff-cni /etc/cni/net.d/10-skiff.conflist /etc/systemd/system/skiffd.service \
	/usr/share/doc/skiff/install.md /usr/lib/skiff/installed /usr/lib/skiff/ /usr/share/doc/skiff/)
[ "$(cat "$dest/usr/lib/skiff/installed")" = "$want" ] || fail "the list for skiff uninstall: $(cat "$dest/usr/lib/skiff/installed")"
unit="$dest/etc/systemd/system/skiffd.service"
grep -q '^ExecStart=/usr/bin/skiffd --config /etc/skiff/skiffd.conf$' "$unit" || fail "unit ExecStart: $(grep ExecStart "$unit")"
grep -q '^KillMode=process$' "$unit" || fail "unit KillMode"
! grep -q @ "$unit" || fail "unfilled placeholder in the unit"
python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$dest/etc/cni/net.d/10-skiff.conflist" || fail "conflist is not JSON"
out=$("$dest/usr/bin/skiffd" --config "$dest/etc/skiff/skiffd.conf" --version) || fail "skiffd refuses the default config"
[[ $out == "skiffd "* ]] || fail "skiffd --version: $out"
"$dest/usr/bin/skiffd" --help >/dev/null 2>&1 || fail "skiffd --help exits $?"
echo 'mode = auto' >> "$dest/etc/skiff/skiffd.conf"
make -s install DESTDIR="$dest" PREFIX=/usr >/dev/null
tail -1 "$dest/etc/skiff/skiffd.conf" | grep -q 'mode = auto' || fail "install overwrote the host's config"
make -s uninstall DESTDIR="$dest" PREFIX=/usr
left=$(cd "$dest" && find . -type f | sort)
[ "$left" = "./etc/skiff/skiffd.conf" ] || fail "left after uninstall: $left"
echo "install-check: ok"
