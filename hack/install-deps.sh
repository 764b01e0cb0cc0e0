#!/usr/bin/env bash
# Installs the Debian packages the tests and `make run` need, when missing:
# QEMU, swtpm and OVMF, and systemd for systemd-analyze (the units in
# deploy/systemd are verified, never started). Runs apt-get as root, or through sudo.
set -euo pipefail
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86 qemu-utils)
command -v swtpm >/dev/null || need+=(swtpm swtpm-tools)
[ -e /usr/share/OVMF/OVMF_CODE_4M.fd ] || need+=(ovmf)
command -v npm >/dev/null || need+=(npm)
command -v systemd-analyze >/dev/null || need+=(systemd)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
echo "installing ${need[*]}" >&2
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need[@]}"
