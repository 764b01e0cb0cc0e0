#!/usr/bin/env bash
# Builds vm-base, the project's immutable Debian 13 image (contract §8.1, docs/guest.md):
#   <OUT>/vm-base_<v>.efi           the UKI: Debian's kernel, a dracut initrd (systemd,
#                                   networkd, veritysetup, pcrphase, Ignition, vm-agent),
#                                   a command line with roothash=; systemd-stub 257 (ukify)
#   <OUT>/vm-base_<v>.raw           the disk: ESP (systemd-boot + the UKI), erofs root,
#                                   its dm-verity hash partition, an ext4 var partition
#   <OUT>/vm-base_<v>.policy.json   PCR 11 per phase, PCR 13 per Kubernetes version, the
#                                   golden firmware PCRs of one measuring boot
#   <OUT>/vm-base_<v>.manifest      every package and tool version that went in
#   <OUT>/vm-base_<v>.sysupdate/kubernetes/
#                                   kubernetes_<v>.raw (containerd and runc from Debian, plus
#                                   the Kubernetes binaries of KUBE_BIN_DIR) and SHA256SUMS: the
#                                   image's own sysext tree (the test guests keep sysupdate/)
#
# Reproducible: the package sets are pinned (guest/os/packages.lock and tools.lock; a
# missing lock is written from what the mirror has), file times are SOURCE_DATE_EPOCH,
# partition and filesystem ids derive from a fixed seed. The bootstrapped trees and the
# Ignition build are cached in VMM_OS_CACHE keyed on their inputs.
#
# usage: hack/os-image.sh [OUT]     (root: mmdebstrap, chroot and bind mounts)
# env:   OS_VERSION (0.1.0), VMM_OS_CACHE (~/.cache/vm-manager/os-image),
#        DEBIAN_MIRROR (http://deb.debian.org/debian), KUBERNETES_VERSION (the sysext's
#        version), KUBE_BIN_DIR (kubelet, kubeadm, kubectl to add to it), OS_NO_MEASURE=1
#        (skip the measuring boot: golden firmware PCRs left out)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OS="$ROOT/guest/os"
OUT="${1:-$ROOT/build/os/images}"
VERSION="${OS_VERSION:-0.1.0}"
STEM="vm-base_$VERSION"
SUITE=trixie
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="${VMM_OS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vm-manager/os-image}"
BUILD="$ROOT/build/os"
WORK="$BUILD/work"
KUBERNETES_VERSION="${KUBERNETES_VERSION:-1.34.2}"
IGNITION_VERSION=v2.24.0
# 2025-12-01: every file time in the image.
export SOURCE_DATE_EPOCH=1764547200
# repart's seed: partition UUIDs, the GPT's id and filesystem UUIDs derive from it.
SEED=564d4d42-4153-4500-8000-000000000001
# The kernel's command line. The initrd attests and Ignition fetches over the
# network (ip=dhcp); a failure in the initrd powers the VM off instead of
# waiting at a shell (rd.shell=0 rd.emergency=poweroff), so the host sees it.
CMDLINE="console=ttyS0,115200 root=/dev/mapper/root rootfstype=erofs ro roothash=@ROOTHASH@ rd.neednet=1 ip=dhcp ignition.platform.id=metal ignition.config.url=http://169.254.169.254/giantswarm/v1/user-data rd.shell=0 rd.emergency=poweroff systemd.gpt_auto=0 panic=-1"
# dracut: the modules the boot needs and nothing else (a no-hostonly initrd is
# twice the size and slow to measure and unpack under TCG).
# guest/os/dracut overrides two of Debian's (tpm2-tss, kernel-network-modules) with
# what a VM uses, and the build drops url-lib from Ignition's: every MB of the
# initrd costs about 0.25 s of each boot under TCG (hashed by the firmware and
# both stubs, then unpacked).
DRACUT_MODULES="systemd systemd-initrd systemd-journald systemd-udevd systemd-modules-load systemd-sysctl systemd-tmpfiles systemd-veritysetup systemd-pcrphase tpm2-tss systemd-networkd dracut-systemd udev-rules base fs-lib rootfs-block dm kernel-modules network qemu ignition shutdown vmm"
DRACUT_DRIVERS="virtio_pci virtio_blk virtio_net virtio_console virtio_rng dm_mod dm_verity erofs ext4 overlay tpm_crb tpm_tis efivarfs"
# dm's module installs all of drivers/md: software RAID, bcache, VDO, thin pools,
# dm-crypt... The root needs dm-verity alone (and its dm-bufio, reed_solomon).
DRACUT_OMIT_DRIVERS="raid0 raid1 raid10 raid456 raid6_pq async_.* xor bcache md_mod persistent_data dm_persistent_data dm_(bio_prison|cache.*|crypt|delay|era|flakey|integrity|log.*|mirror|multipath|queue_length|raid|region_hash|round_robin|service_time|snapshot|switch|thin_pool|unstripe|vdo|writecache|zero|zoned) ahci ata_generic ata_piix libahci libata hv_vmbus pci_hyperv_intf xen_tpmfront tpm_vtpm_proxy"

log() { echo "os-image: $*" >&2; }
die() { log "$*"; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap, chroot, bind mounts)"
command -v mmdebstrap >/dev/null || { apt-get update -q >&2; DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends mmdebstrap >&2; }
for tool in go gcc; do command -v "$tool" >/dev/null || die "$tool missing"; done
[ -e /usr/include/blkid/blkid.h ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libblkid-dev >&2

mkdir -p "$CACHE" "$BUILD" "$OUT"
OUT="$(cd "$OUT" && pwd)"
exec 9>"$CACHE/.lock"
flock 9

pkgs() { grep -v '^#' "$1" | sed '/^$/d' | paste -sd, -; }
hash16() { sha256sum | cut -c1-16; }

# bootstrap NAME LIST LOCK: a trixie tree in the cache, with exactly the versions
# LOCK pins (written from what the mirror has when LOCK is missing). Prints its path.
bootstrap() {
  local name="$1" list="$2" lock="$3" dest inc
  dest="$CACHE/$name-$({ echo "$SUITE $MIRROR"; cat "$list" "$lock" 2>/dev/null; cat "$OS/setup-hook.sh"; } | hash16)"
  if [ ! -e "$dest/.done" ]; then
    rm -rf "$dest" "$dest.tmp"
    if [ -s "$lock" ]; then inc="$(awk '!/^#/ && NF == 2 { printf "%s%s=%s", sep, $1, $2; sep = "," }' "$lock")"; else inc="$(pkgs "$list")"; fi
    log "bootstrapping $name ($(basename "$dest"))"
    mmdebstrap --quiet --variant=minbase --aptopt='Apt::Install-Recommends "false"' \
      --setup-hook="sh $OS/setup-hook.sh \"\$1\"" --include="$inc" "$SUITE" "$dest.tmp" "$MIRROR" >&2
    chroot "$dest.tmp" dpkg-query -W -f '${Package} ${Version}\n' | LC_ALL=C sort >"$dest.tmp/.packages"
    if [ ! -s "$lock" ]; then
      { echo "# $name: the pinned package set (hack/os-image.sh writes it when missing; commit it)"; cat "$dest.tmp/.packages"; } >"$lock"
      log "wrote $lock: commit it"
    elif ! diff <(grep -v '^#' "$lock") "$dest.tmp/.packages" >&2; then
      die "$name: the mirror's packages are not the lock's (above); the mirror moved on: delete $lock to pin the new set"
    fi
    touch "$dest.tmp/.done"
    mv "$dest.tmp" "$dest"
  fi
  echo "$dest"
}

# ---- the trees ---------------------------------------------------------------
TOOLS="$(bootstrap tools "$OS/tools-packages" "$OS/tools.lock")"
BASE="$(bootstrap rootfs "$OS/packages" "$OS/packages.lock")"

# Ignition from the Go module proxy: Debian's 2.14 knows config 3.4.0 only as
# experimental. Static (its cgo part is libblkid), no SELinux relabel (Debian has none),
# metal only (guest/os/ignition-metal-only.patch: 10 MB instead of 44, which every
# boot hashes and unpacks).
IGN_PATCH="$OS/ignition-metal-only.patch"
IGN_KEY="$( { echo "$IGNITION_VERSION"; go version; dpkg-query -W libblkid-dev; cat "$IGN_PATCH"; } | hash16)"
IGNITION="$CACHE/ignition-$IGN_KEY/ignition"
if [ ! -x "$IGNITION" ]; then
  log "building Ignition $IGNITION_VERSION (metal only)"
  src="$CACHE/ignition-$IGN_KEY/src"
  rm -rf "$src" "$IGNITION.tmp" && mkdir -p "$src"
  moddir="$(cd "$ROOT" && GOWORK=off GOFLAGS=-mod=mod go mod download -json "github.com/coreos/ignition/v2@$IGNITION_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  cp -r "$moddir/." "$src/" && chmod -R u+w "$src"
  rm "$src/internal/resource/url_test.go" # tests the fetchers the patch removes
  patch -s -p1 -d "$src" <"$IGN_PATCH" || die "the Ignition patch does not apply to $IGNITION_VERSION"
  (cd "$src" && GOWORK=off CGO_ENABLED=1 GOFLAGS=-mod=mod go build -trimpath -buildvcs=false -tags netgo,osusergo \
    -ldflags "-s -w -buildid= -linkmode external -extldflags -static -X github.com/coreos/ignition/v2/internal/distro.selinuxRelabel=false -X github.com/coreos/ignition/v2/internal/version.Raw=$IGNITION_VERSION" \
    -o "$IGNITION.tmp" ./internal 2>&1 | grep -v 'statically linked applications requires\|in function .\(group\|user\)_lookup_fn' >&2 || true)
  [ -x "$IGNITION.tmp" ] || die "Ignition did not build"
  mv "$IGNITION.tmp" "$IGNITION"
  rm -rf "$src"
fi

(
  cd "$ROOT/guest"
  CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go build -trimpath -buildvcs=false \
    -ldflags "-s -w -X github.com/giantswarm/vm-manager/guest/internal/version.Version=$VERSION" \
    -o "$BUILD/vm-agent" ./cmd/vm-agent
  CGO_ENABLED=0 go build -trimpath -buildvcs=false -o "$BUILD/mkuki" ./cmd/mkuki
)

# ---- the root ----------------------------------------------------------------
# Chroots get /proc, /sys and /dev (repart and dracut need them), and the tools'
# chroot the work directory at /work.
R="$WORK/rootfs"
MOUNTS=()
bind() { mkdir -p "$2" && mount --bind "$1" "$2" && MOUNTS=("$2" "${MOUNTS[@]}"); }
cleanup() { for m in "${MOUNTS[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done; }
trap cleanup EXIT
for m in "$TOOLS/work" "$TOOLS/proc" "$TOOLS/sys" "$TOOLS/dev" "$R/proc" "$R/sys" "$R/dev"; do umount -l "$m" 2>/dev/null || true; done
rm -rf "$WORK"
mkdir -p "$WORK"
bind "$WORK" "$TOOLS/work"
for d in proc sys dev; do bind "/$d" "$TOOLS/$d"; done
log "root tree"
cp -a "$BASE" "$R"
rm -f "$R/.done" "$R/.packages"
cp -a "$OS/rootfs/." "$R/"
install -m 0755 "$BUILD/vm-agent" "$R/usr/bin/vm-agent"
install -m 0755 "$IGNITION" "$R/usr/lib/dracut/modules.d/30ignition/ignition"
cp -a "$OS/dracut/." "$R/usr/lib/dracut/modules.d/"
chmod 0755 "$R"/usr/lib/dracut/modules.d/{90vmm,91tpm2-tss,90kernel-network-modules}/module-setup.sh
# Ignition fetches with its own HTTP client: dracut's url-lib (curl, its TLS stacks
# and CA bundle) has nothing to do in the initrd.
sed -i 's/^\(    echo qemu systemd\) url-lib network$/\1 network/' "$R/usr/lib/dracut/modules.d/30ignition/module-setup.sh"
grep -q '^    echo qemu systemd network$' "$R/usr/lib/dracut/modules.d/30ignition/module-setup.sh" || die "30ignition's depends() changed: check url-lib"
# Nor tpm2_create, which it takes for Clevis (not installed): it brings tpm2-tools
# and with them curl, GnuTLS and Kerberos.
sed -i '/^        tpm2_create$/d' "$R/usr/lib/dracut/modules.d/30ignition/module-setup.sh"
! grep -q 'tpm2_create' "$R/usr/lib/dracut/modules.d/30ignition/module-setup.sh" || die "30ignition's install() changed: check tpm2_create"
cat >>"$R/usr/lib/os-release" <<EOF
IMAGE_ID=vm-base
IMAGE_VERSION=$VERSION
EOF
# Per VM, not per image: host keys (sshd-keygen makes them on the first boot), the
# machine id (the system.machine_id credential; "uninitialized" makes the first boot
# a first boot, which applies the presets Ignition writes), the hostname (the IMDS).
rm -f "$R"/etc/ssh/ssh_host_* "$R/var/lib/dbus/machine-id"
printf 'uninitialized\n' >"$R/etc/machine-id"
printf 'localhost\n' >"$R/etc/hostname"
# systemd-firstboot would ask on the console; the IMDS and credentials answer instead.
ln -sf /dev/null "$R/etc/systemd/system/systemd-firstboot.service"
# Under TCG every process systemd spawns early costs about a second of both vCPUs
# (systemd-analyze blame of the first boot, docs/guest.md). Masked: what this OS does
# not use. The TPM's SRK and PCR 15 (nothing seals to them; the policy has no PCR 15),
# pcrlock, a network config from ip= (the initrd's), udev credentials, DRM; and the
# generators of what it does not have (crypttab, integritytab, GPT auto-discovery,
# hibernation, rc.local, SysV scripts, sshd on vsock, offline updates), which also ran
# again at every daemon-reload. And dracut's shutdown hook, which unpacks an initramfs
# from /boot into /run on every boot so that shutdown can return to it: there is none
# (it is in the UKI), and the read-only verity root needs no teardown from one.
for u in systemd-tpm2-setup-early.service systemd-tpm2-setup.service systemd-pcrmachine.service \
  systemd-network-generator.service systemd-udev-load-credentials.service modprobe@drm.service \
  dracut-shutdown.service dracut-shutdown-onfailure.service; do
  ln -sf /dev/null "$R/etc/systemd/system/$u"
done
install -d "$R/etc/systemd/system-generators"
for g in cryptsetup gpt-auto hibernate-resume integritysetup rc-local run ssh system-update sysv tpm2; do
  ln -sf /dev/null "$R/etc/systemd/system-generators/systemd-$g-generator"
done
# The root is read-only: homes live on var.
rm -rf "$R/root" "$R/home"
install -d -m 0700 "$R/var/roothome"
install -d -m 0755 "$R/var/home"
ln -s var/roothome "$R/root"
ln -s var/home "$R/home"
chroot "$R" systemctl preset-all >/dev/null 2>&1
# Every user and group of sysusers.d now, not at the first boot (see .updated below).
chroot "$R" systemd-sysusers >/dev/null
# What differs between two bootstraps of the same packages, and build leftovers.
rm -rf "$R"/var/log/* "$R"/var/cache/* "$R"/var/lib/apt/lists/* "$R"/etc/*- "$R"/var/lib/dpkg/*-old \
  "$R"/etc/dracut.conf.d/00-vmm-build.conf "$R/etc/resolv.conf"
KVERS=("$R"/usr/lib/modules/*)
[ ${#KVERS[@]} -eq 1 ] || die "expected one kernel in the root"
KVER="$(basename "${KVERS[0]}")"

log "initrd (dracut, kernel $KVER)"
for d in proc sys dev; do bind "/$d" "$R/$d"; done
chroot "$R" dracut --quiet --force --reproducible --no-hostonly --no-hostonly-cmdline --nofscks \
  -m "$DRACUT_MODULES" --drivers "$DRACUT_DRIVERS" --omit-drivers "$DRACUT_OMIT_DRIVERS" --compress zstd --kver "$KVER" /var/tmp/vmm-initrd.img >&2
for d in dev sys proc; do umount "$R/$d"; done
mv "$R/var/tmp/vmm-initrd.img" "$WORK/initrd.img"
cp "$R/boot/vmlinuz-$KVER" "$WORK/vmlinuz"
cp "$R/usr/lib/os-release" "$WORK/os-release"
# The kernel and initrd live in the UKI; the root keeps only the modules.
rm -rf "$R"/boot/* "$R"/vmlinuz* "$R"/initrd.img*
# /usr is as new as /etc and /var say they were updated for: the first boot skips
# ConditionNeedsUpdate= (ldconfig, sysusers, hwdb, the journal catalog), which the
# build already did.
for d in etc var; do printf 'TIMESTAMP_NSEC=%s000000000\n' "$SOURCE_DATE_EPOCH" >"$R/$d/.updated"; done
find "$R" -newermt "@$SOURCE_DATE_EPOCH" -print0 | xargs -0r touch -h -d "@$SOURCE_DATE_EPOCH"

# ---- the Kubernetes system extension ------------------------------------------
# containerd and runc as Debian ships them (installed in the tools tree, so tools.lock
# pins them), the Kubernetes binaries when KUBE_BIN_DIR has them.
SYSEXT="$WORK/sysupdate/kubernetes"
tree="$WORK/sysext/kubernetes_$KUBERNETES_VERSION"
mkdir -p "$SYSEXT" "$tree/usr/lib/extension-release.d"
chroot "$TOOLS" dpkg -L containerd runc | grep '^/usr/' | while read -r f; do
  if [ -f "$TOOLS$f" ] && [ ! -L "$TOOLS$f" ]; then install -D -m "$(stat -c %a "$TOOLS$f")" "$TOOLS$f" "$tree$f"; fi
done
if [ -n "${KUBE_BIN_DIR:-}" ]; then
  for b in kubelet kubeadm kubectl; do install -D -m 0755 "$KUBE_BIN_DIR/$b" "$tree/usr/bin/$b"; done
fi
printf 'ID=debian\nVERSION_ID=13\nSYSEXT_SCOPE=system\nKUBERNETES_VERSION=%s\n' "$KUBERNETES_VERSION" \
  >"$tree/usr/lib/extension-release.d/extension-release.kubernetes_$KUBERNETES_VERSION"
find "$tree" -print0 | xargs -0r touch -h -d "@$SOURCE_DATE_EPOCH"
chroot "$TOOLS" mkfs.erofs --quiet -T "$SOURCE_DATE_EPOCH" -U 564d4d42-4153-4500-8000-00000000000b --all-root \
  -zlz4hc "/work/sysupdate/kubernetes/kubernetes_$KUBERNETES_VERSION.raw" "/work/sysext/kubernetes_$KUBERNETES_VERSION" >&2
(cd "$SYSEXT" && sha256sum kubernetes_*.raw >SHA256SUMS)

# ---- the disk and the UKI -----------------------------------------------------
# Two systemd-repart passes (realos.md): the first writes root, its verity hash and
# var and names the root hash; the UKI's command line needs it; the second fills the
# ESP with the UKI. 512-byte sectors: OVMF refuses a FAT with 4K sectors this small.
cp -a "$OS/repart.d" "$WORK/repart.d"
repart() {
  chroot "$TOOLS" env SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" E2FSPROGS_FAKE_TIME="$SOURCE_DATE_EPOCH" \
    SYSTEMD_REPART_MKFS_OPTIONS_EXT4="-E hash_seed=$SEED" \
    systemd-repart --offline=yes --sector-size=512 --seed="$SEED" --definitions=/work/repart.d \
    --dry-run=no --no-pager --json=short "$@" /work/disk.raw
}
log "disk: root, verity, var"
repart --empty=create --size=auto --defer-partitions=esp >"$WORK/repart.json"
ROOTHASH="$(python3 -c 'import json,sys; print(next(p["roothash"] for p in json.load(open(sys.argv[1])) if p.get("roothash")))' "$WORK/repart.json")"
[[ "$ROOTHASH" =~ ^[0-9a-f]{64}$ ]] || die "no root hash from systemd-repart"
printf '%s' "${CMDLINE/@ROOTHASH@/$ROOTHASH}" >"$WORK/cmdline"

log "UKI (ukify, systemd-stub 257)"
chroot "$TOOLS" env SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" ukify build \
  --linux /work/vmlinuz --initrd /work/initrd.img --cmdline @/work/cmdline \
  --os-release @/work/os-release --uname "$KVER" \
  --stub /usr/lib/systemd/boot/efi/linuxx64.efi.stub \
  --measure --output /work/uki.efi >"$WORK/ukify.out"

ESP="$WORK/esp"
mkdir -p "$ESP/EFI/BOOT" "$ESP/EFI/Linux" "$ESP/loader"
cp "$TOOLS/usr/lib/systemd/boot/efi/systemd-bootx64.efi" "$ESP/EFI/BOOT/BOOTX64.EFI"
cp "$WORK/uki.efi" "$ESP/EFI/Linux/$STEM.efi"
printf 'timeout 0\neditor no\nauto-entries no\nauto-firmware no\nrandom-seed-mode off\n' >"$ESP/loader/loader.conf"
find "$ESP" -print0 | xargs -0r touch -h -d "@$SOURCE_DATE_EPOCH"
log "disk: ESP"
repart >/dev/null

# ---- the policy ---------------------------------------------------------------
"$BUILD/mkuki" -uki "$WORK/uki.efi" -loader "$ESP/EFI/BOOT/BOOTX64.EFI" -policy "$WORK/policy.json" -image-id vm-base \
  -image-version "$VERSION" -sha256sums "$SYSEXT/SHA256SUMS"
# mkuki's PCR 11 must be systemd-measure's (run by ukify --measure): it prints
# one value per bank for each phase path, in the order of its defaults.
python3 - "$WORK/policy.json" "$WORK/ukify.out" <<'PY'
import json, re, sys
pol = json.load(open(sys.argv[1]))["pcr11"]
got = re.findall(r"^11:sha256=([0-9a-f]{64})$", open(sys.argv[2]).read(), re.M)
phases = ["enter-initrd", "enter-initrd:leave-initrd", "enter-initrd:leave-initrd:sysinit", "enter-initrd:leave-initrd:sysinit:ready"]
measured = dict(zip(phases, got))
for phase, want in pol.items():
    if measured.get(phase) != want:
        sys.exit(f"os-image: PCR 11 for {phase}: mkuki says {want}, systemd-measure says {measured.get(phase)}")
PY

{
  echo "# $STEM: what went in"
  echo "kernel $KVER"
  echo "ignition $IGNITION_VERSION ($(go version | cut -d' ' -f3))"
  echo "roothash $ROOTHASH"
  echo "cmdline $(cat "$WORK/cmdline")"
  echo "## guest packages"; grep -v '^#' "$OS/packages.lock"
  echo "## build tools"; grep -v '^#' "$OS/tools.lock"
} >"$WORK/manifest"

# Golden firmware PCRs: one boot of the disk on this host's QEMU, OVMF and swtpm,
# redone only when one of them or the image changed (as for the UKI test guest).
if [ "${OS_NO_MEASURE:-}" != 1 ]; then
  (cd "$ROOT/services/hypervisor" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -o "$BUILD/vmm-hypervisor" ./cmd/vmm-hypervisor)
  MDIR="$WORK/measure"
  mkdir -p "$MDIR"
  ln -f "$WORK/uki.efi" "$MDIR/$STEM.efi"
  ln -f "$WORK/disk.raw" "$MDIR/$STEM.raw"
  cp "$WORK/policy.json" "$MDIR/$STEM.policy.json"
  inputs="$({ sha256sum "$MDIR/$STEM".{efi,raw,policy.json} /usr/share/OVMF/*.fd "$BUILD/vmm-hypervisor"; qemu-system-x86_64 --version; swtpm --version; } 2>&1 | sha256sum | cut -d' ' -f1)"
  MEASURED="$CACHE/measured-$inputs.json"
  if [ ! -s "$MEASURED" ]; then
    log "measuring boot (golden firmware PCRs)"
    "$BUILD/vmm-hypervisor" image measure --image-dir "$MDIR" "$STEM" >&2
    cp "$MDIR/$STEM.policy.json" "$MEASURED.tmp" && mv "$MEASURED.tmp" "$MEASURED"
  fi
  cp "$MEASURED" "$WORK/policy.json"
  # PCR 9 is left out: Linux 6.12's EFI stub measures the command line there,
  # and systemd-stub appends the host's ignition.firstboot on a first boot, so
  # its value differs between a VM's boots. Nothing goes unguarded: PCR 11
  # holds the UKI's command line and initrd, PCR 12 anything appended to it
  # (the verifier expects the first boot's extra there), PCR 4 the boot chain.
  python3 - "$WORK/policy.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p["golden"]["sha256"].pop("9", None)
json.dump(p, open(sys.argv[1], "w"), indent=2, sort_keys=True)
open(sys.argv[1], "a").write("\n")
PY
fi

# ---- outputs --------------------------------------------------------------------
put() { # src dst: replace dst atomically
  local tmp; tmp="$(dirname "$2")/.$(basename "$2").tmp.$$"
  cp "$1" "$tmp" && chmod 0644 "$tmp" && mv -f "$tmp" "$2"
}
mkdir -p "$OUT/$STEM.sysupdate/kubernetes"
put "$WORK/uki.efi" "$OUT/$STEM.efi"
put "$WORK/disk.raw" "$OUT/$STEM.raw"
put "$WORK/policy.json" "$OUT/$STEM.policy.json"
put "$WORK/manifest" "$OUT/$STEM.manifest"
for f in "$SYSEXT"/*; do put "$f" "$OUT/$STEM.sysupdate/kubernetes/$(basename "$f")"; done
log "$OUT/$STEM.{efi,raw,policy.json,manifest} and $STEM.sysupdate/kubernetes (kubernetes $KUBERNETES_VERSION): UKI $(du -h "$OUT/$STEM.efi" | cut -f1), disk $(du -h --apparent-size "$OUT/$STEM.raw" | cut -f1), roothash ${ROOTHASH:0:16}…"
