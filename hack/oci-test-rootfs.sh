#!/usr/bin/env bash
# Unpacks the root file system of the OCI test image: Debian's python3
# (python3-minimal and what it needs) and busybox-static for /bin/sh, from the
# host's apt sources. The tests build an OCI image of it and push it to a
# registry on loopback; no image registry on the internet is involved.
# Cached in build/oci (gitignored), redone when a package version changes.
#
# usage: hack/oci-test-rootfs.sh [OUT]     prints the rootfs directory
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build/oci"
OUT="${1:-$BUILD/python-rootfs}"
PKGS="python3-minimal python3.11-minimal libpython3.11-minimal libc6 libexpat1 zlib1g libssl3 busybox-static"

mkdir -p "$BUILD/debs"
exec 9>"$BUILD/.lock"
flock 9

versions() {
  local p v out=""
  for p in $PKGS; do
    v="$(apt-cache show --no-all-versions "$p" 2>/dev/null | awk '$1 == "Version:" { print $2; exit }')"
    [ -n "$v" ] || return 1
    out+="$p=$v "
  done
  echo "$out"
}
if ! want="$(versions)"; then
  [ "$(id -u)" -eq 0 ] || { echo "oci-test-rootfs: cannot resolve $PKGS (apt lists missing? run apt-get update as root)" >&2; exit 1; }
  apt-get update -q >&2
  want="$(versions)"
fi

if [ "$(cat "$OUT.stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$OUT/usr/bin/python3" ]; then
  rm -rf "$OUT" "$OUT.stamp" "$BUILD"/debs/*.deb
  sandbox=()
  [ "$(id -u)" -eq 0 ] && sandbox=(-o APT::Sandbox::User=root)
  # shellcheck disable=SC2086
  (cd "$BUILD/debs" && apt-get download -q "${sandbox[@]}" $want >&2)
  mkdir -p "$OUT"
  for deb in "$BUILD"/debs/*.deb; do
    dpkg-deb -x "$deb" "$OUT"
  done
  # busybox-static ships /bin/busybox only: the links a shell needs.
  for applet in sh ls cat echo id env; do
    [ -e "$OUT/bin/$applet" ] || ln -s busybox "$OUT/bin/$applet"
  done
  mkdir -p "$OUT/etc" "$OUT/home/app" "$OUT/tmp"
  chmod 1777 "$OUT/tmp"
  printf 'root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n' >"$OUT/etc/passwd"
  printf 'root:x:0:\napp:x:1000:\n' >"$OUT/etc/group"
  chown 1000:1000 "$OUT/home/app" 2>/dev/null || true
  echo "$want" >"$OUT.stamp"
fi
echo "$OUT"
