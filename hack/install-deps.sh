#!/usr/bin/env bash
# Installs the Debian packages the tests and `make run` need, when missing:
# QEMU, swtpm and OVMF, systemd for systemd-analyze (the units in
# deploy/systemd are verified, never started) and systemd-measure, and what the
# UKI test guest is built with (hack/uki-image.sh): systemd-stub, objcopy,
# mtools, sfdisk, mkfs.erofs. Runs apt-get as root, or through sudo.
set -euo pipefail
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86 qemu-utils)
command -v qemu-img >/dev/null || need+=(qemu-utils)
command -v swtpm >/dev/null || need+=(swtpm swtpm-tools)
[ -e /usr/share/OVMF/OVMF_CODE_4M.fd ] || need+=(ovmf)
command -v npm >/dev/null || need+=(npm)
command -v systemd-analyze >/dev/null || need+=(systemd)
[ -e /usr/lib/systemd/boot/efi/linuxx64.efi.stub ] || need+=(systemd-boot-efi)
command -v objcopy >/dev/null || need+=(binutils)
command -v mcopy >/dev/null || need+=(mtools)
command -v sfdisk >/dev/null || need+=(fdisk)
command -v mkfs.erofs >/dev/null || need+=(erofs-utils)
command -v osslsigncode >/dev/null || need+=(osslsigncode)  # Authenticode test (pkg/measure)
command -v patch >/dev/null || need+=(patch)  # hack/os-image.sh: the Ignition patch
command -v veritysetup >/dev/null || [ -x /usr/sbin/veritysetup ] || need+=(cryptsetup-bin)  # the verity package's test against veritysetup
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
echo "installing ${need[*]}" >&2
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need[@]}"
