#!/usr/bin/env bash
# Builds the project's test guests:
#   <IMAGE_DIR>/test-guest_<version>.{vmlinuz,initrd,cmdline}        direct-kernel image
#   <IMAGE_DIR>/test-guest-uki_<version>.{efi,raw,policy.json}       UKI image (hack/uki-image.sh)
#   <IMAGE_DIR>/sysupdate/kubernetes/{kubernetes_<v>.raw,SHA256SUMS} Kubernetes system extensions
# Kernel: the package linux-image-cloud-amd64 depends on (LZ4, boots 2x faster under TCG
# than the generic XZ kernel). Initramfs: vm-agent as /init, busybox, virtio modules.
# Debian packages go to build/guest (gitignored); no root needed when apt lists exist.
#
# The UKI's policy is complete when built: PCR 11 and 13 are computed (mkuki), and the
# golden firmware PCRs come from one boot of its disk on this host's firmware
# (vmm-hypervisor image measure, redone only when an input changed).
#
# usage: hack/guest-image.sh [IMAGE_DIR]      env: GUEST_VERSION (default 0.1.0)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE_DIR="${1:-$ROOT/.run/state/images}"
VERSION="${GUEST_VERSION:-0.1.0}"
BUILD="$ROOT/build/guest"
DEBS="$BUILD/debs"
STEM="test-guest_$VERSION"
UKI_STEM="test-guest-uki_$VERSION"
# The Kubernetes versions the sysext tree offers (tiny stand-ins: an extension-release
# and a kubelet that prints its version).
KUBERNETES_VERSIONS="1.33.6 1.34.2"
# No "quiet": measured under TCG it saves nothing (kernel-to-ready ~2.2 s either way)
# and the kernel log is what explains a failed boot.
CMDLINE="console=ttyS0 panic=-1"
# Load order: mkinitramfs adds dependencies from each module's .modinfo.
# button + evdev: the ACPI power button reaches vm-agent as KEY_POWER.
MODULES="virtio_pci,virtio_net,virtio_blk,virtio_console,virtio_rng,vmw_vsock_virtio_transport,button,evdev,loop,libcrc32c,erofs,efivarfs,dm_mod,dm_verity,overlay"

mkdir -p "$IMAGE_DIR" "$DEBS"
IMAGE_DIR="$(cd "$IMAGE_DIR" && pwd)"
# Tests in several modules may build the image at once: build/guest is shared.
exec 9>"$BUILD/.lock"
flock 9

# apt without lists (or with stale ones) fails; as root, run apt-get update once.
updated=""
can_update() { [ "$(id -u)" -eq 0 ] && [ -z "$updated" ]; }
apt_update() {
  echo "guest-image: apt failed; running apt-get update once" >&2
  updated=1
  apt-get update -q >&2
}

# KPKG: the versioned kernel package (e.g. linux-image-6.1.0-57-cloud-amd64).
resolve() {
  KPKG="$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
    awk '$1 == "Depends:" && $2 ~ /^linux-image-/ { print $2; exit }')" &&
    KVER_PKG="$(pkg_version "$KPKG")" && BBVER_PKG="$(pkg_version busybox-static)" &&
    [ -n "$KPKG" ] && [ -n "$KVER_PKG" ] && [ -n "$BBVER_PKG" ]
}
pkg_version() { apt-cache show --no-all-versions "$1" 2>/dev/null | awk '$1 == "Version:" { print $2; exit }'; }

fetch() {
  rm -f "$DEBS"/*.deb
  local sandbox=()
  # As root apt drops to _apt, which cannot write to a root-owned build dir.
  [ "$(id -u)" -eq 0 ] && sandbox=(-o APT::Sandbox::User=root)
  (cd "$DEBS" && apt-get download -q "${sandbox[@]}" "$KPKG=$KVER_PKG" "busybox-static=$BBVER_PKG" >&2)
}

if ! resolve; then
  can_update || { echo "guest-image: cannot resolve linux-image-cloud-amd64 and busybox-static (apt lists missing? run apt-get update as root)" >&2; exit 1; }
  apt_update
  resolve || { echo "guest-image: cannot resolve linux-image-cloud-amd64 and busybox-static" >&2; exit 1; }
fi

if [ "$(cat "$BUILD/stamp" 2>/dev/null)" != "$KPKG=$KVER_PKG busybox-static=$BBVER_PKG" ]; then
  rm -f "$BUILD/stamp"
  echo "guest-image: fetching $KPKG=$KVER_PKG busybox-static=$BBVER_PKG" >&2
  if ! fetch; then
    # Stale lists name versions the mirror no longer has: update, re-resolve, retry.
    can_update || { echo "guest-image: apt-get download failed" >&2; exit 1; }
    apt_update
    resolve && fetch || { echo "guest-image: apt-get download failed" >&2; exit 1; }
  fi
  rm -rf "$BUILD/kernel" "$BUILD/busybox"
  dpkg-deb -x "$DEBS/${KPKG}_"*.deb "$BUILD/kernel"
  dpkg-deb -x "$DEBS/busybox-static_"*.deb "$BUILD/busybox"
  # Debian 6.1 ships plain .ko; later kernels compress them, finit_module here wants plain.
  find "$BUILD/kernel/lib/modules" -name '*.ko.xz' -exec xz -d {} +
  find "$BUILD/kernel/lib/modules" -name '*.ko.zst' -exec zstd -q -d --rm {} +
  echo "$KPKG=$KVER_PKG busybox-static=$BBVER_PKG" >"$BUILD/stamp"
fi

KDIRS=("$BUILD"/kernel/lib/modules/*)
[ ${#KDIRS[@]} -eq 1 ] && [ -d "${KDIRS[0]}" ] || { echo "guest-image: expected one kernel in $BUILD/kernel" >&2; exit 1; }
KVER="$(basename "${KDIRS[0]}")"

# -buildvcs=false: the initrd must not change with the repository's dirty state.
(
  cd "$ROOT/guest"
  export CGO_ENABLED=0 GOOS=linux GOARCH=amd64
  go build -trimpath -buildvcs=false \
    -ldflags "-s -w -X github.com/giantswarm/vm-manager/guest/internal/version.Version=$VERSION" \
    -o "$BUILD/vm-agent" ./cmd/vm-agent
)
(
  cd "$ROOT/guest"
  CGO_ENABLED=0 go build -trimpath -buildvcs=false -o "$BUILD/mkinitramfs" ./cmd/mkinitramfs
)

"$BUILD/mkinitramfs" -o "$BUILD/initrd" -init "$BUILD/vm-agent" \
  -busybox "$BUILD/busybox/bin/busybox" \
  -modules "$BUILD/kernel/lib/modules/$KVER" -load "$MODULES"
printf '%s' "$CMDLINE" >"$BUILD/cmdline"

# Replace an output only when its content changed, atomically.
install_if_changed() {
  local src="$1" dst="$IMAGE_DIR/$2"
  if cmp -s "$src" "$dst"; then
    echo "unchanged $dst"
  else
    local tmp; tmp="$(dirname "$dst")/.$(basename "$dst").tmp.$$"
    cp "$src" "$tmp"
    chmod 0644 "$tmp"
    mv -f "$tmp" "$dst"
    echo "wrote $dst"
  fi
}
install_if_changed "$BUILD/kernel/boot/vmlinuz-$KVER" "$STEM.vmlinuz"
install_if_changed "$BUILD/initrd" "$STEM.initrd"
install_if_changed "$BUILD/cmdline" "$STEM.cmdline"

# The Kubernetes system extensions: erofs images with fixed times and UUID.
SYSEXT="$BUILD/sysupdate/kubernetes"
rm -rf "$SYSEXT" && mkdir -p "$SYSEXT"
for kv in $KUBERNETES_VERSIONS; do
  tree="$BUILD/sysext-tree/kubernetes_$kv"
  rm -rf "$tree" && mkdir -p "$tree/usr/lib/extension-release.d" "$tree/usr/bin"
  printf 'ID=_any\nVERSION_ID=%s\n' "$kv" >"$tree/usr/lib/extension-release.d/extension-release.kubernetes_$kv"
  printf '#!/bin/sh\necho "Kubernetes v%s"\n' "$kv" >"$tree/usr/bin/kubelet"
  chmod 0755 "$tree/usr/bin/kubelet"
  mkfs.erofs --quiet -T0 -U 564d4d00-0000-4000-8000-00000000000a --all-root "$SYSEXT/kubernetes_$kv.raw" "$tree"
done
(cd "$SYSEXT" && sha256sum kubernetes_*.raw >SHA256SUMS)
mkdir -p "$IMAGE_DIR/sysupdate/kubernetes"
for f in "$SYSEXT"/*; do install_if_changed "$f" "sysupdate/kubernetes/$(basename "$f")"; done

# The UKI image: the same kernel, initramfs and command line behind systemd-stub.
printf 'ID=vm-manager-test-guest\nNAME="vm-manager test guest"\nVERSION_ID=%s\n' "$VERSION" >"$BUILD/os-release"
UKI="$BUILD/uki"
"$ROOT/hack/uki-image.sh" "$UKI" "$UKI_STEM" "$BUILD/kernel/boot/vmlinuz-$KVER" "$BUILD/initrd" \
  "$BUILD/cmdline" "$BUILD/os-release" "$SYSEXT/SHA256SUMS"

# Golden firmware PCRs: one boot of the disk with this host's QEMU, OVMF and swtpm,
# again only when one of them or the image changed.
(cd "$ROOT/services/hypervisor" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -o "$BUILD/vmm-hypervisor" ./cmd/vmm-hypervisor)
inputs="$({ cat "$UKI/$UKI_STEM".{efi,raw,policy.json} /usr/share/OVMF/*.fd; qemu-system-x86_64 --version; swtpm --version; sha256sum "$BUILD/vmm-hypervisor"; } 2>&1 | sha256sum | cut -d' ' -f1)"
MEASURED="$BUILD/uki-measured"
mkdir -p "$MEASURED"
if [ "$(cat "$MEASURED/stamp" 2>/dev/null)" = "$inputs" ] && [ -s "$MEASURED/policy.json" ]; then
  cp "$MEASURED/policy.json" "$UKI/$UKI_STEM.policy.json"
else
  rm -f "$MEASURED/stamp"
  "$BUILD/vmm-hypervisor" image measure --image-dir "$UKI" "$UKI_STEM" >&2
  cp "$UKI/$UKI_STEM.policy.json" "$MEASURED/policy.json"
  echo "$inputs" >"$MEASURED/stamp"
fi
for ext in efi raw policy.json; do install_if_changed "$UKI/$UKI_STEM.$ext" "$UKI_STEM.$ext"; done
echo "guest-image: kernel $KVER ($KPKG $KVER_PKG), busybox $BBVER_PKG, version $VERSION, kubernetes $KUBERNETES_VERSIONS" >&2
