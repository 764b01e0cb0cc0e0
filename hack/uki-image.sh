#!/usr/bin/env bash
# Builds a UKI image (contract §8.1) from a kernel, an initramfs, a command line
# and an os-release, without root:
#   <OUT_DIR>/<STEM>.efi          the UKI (systemd-stub 252, Debian's systemd-boot-efi)
#   <OUT_DIR>/<STEM>.raw          the disk the installer writes: GPT, one ESP whose
#                                 fallback loader EFI/BOOT/BOOTX64.EFI is that UKI
#   <OUT_DIR>/<STEM>.policy.json  image_id/version, the UKI's section digests, PCR 11
#                                 per boot phase, and with SHA256SUMS the sysext
#                                 digests and PCR 13 per Kubernetes version
# Every output is byte-reproducible (fixed PE timestamp, GPT and FAT ids, FAT times).
#
# usage: hack/uki-image.sh OUT_DIR STEM KERNEL INITRD CMDLINE_FILE OS_RELEASE [SHA256SUMS]
# env:   UKI_LOADER=<efi binary>  put this loader at the ESP's fallback path instead, and
#                                 the UKI at EFI/Linux/<STEM>.efi (a boot chain through
#                                 systemd-boot: the tests' "installer wrote another disk")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 6 ] || { sed -n 's/^# usage: //p' "$0" >&2; exit 2; }
OUT_DIR="$1" STEM="$2" KERNEL="$3" INITRD="$4" CMDLINE="$5" OSREL="$6" SUMS="${7:-}"
STUB=/usr/lib/systemd/boot/efi/linuxx64.efi.stub
[ -r "$STUB" ] || { echo "uki-image: $STUB missing (make deps installs systemd-boot-efi)" >&2; exit 1; }
for tool in objcopy mformat mmd mcopy sfdisk; do
  command -v "$tool" >/dev/null || { echo "uki-image: $tool missing (make deps installs it)" >&2; exit 1; }
done

BUILD="$ROOT/build/guest"
mkdir -p "$BUILD" "$OUT_DIR"
(cd "$ROOT/guest" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -o "$BUILD/mkuki" ./cmd/mkuki)

WORK="$(mktemp -d "${TMPDIR:-/tmp}/uki-image.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

id="${STEM%_*}" version="${STEM##*_}"
policy_args=(-policy "$WORK/policy.json" -image-id "$id" -image-version "$version")
[ -n "$SUMS" ] && policy_args+=(-sha256sums "$SUMS")
"$BUILD/mkuki" -stub "$STUB" -linux "$KERNEL" -initrd "$INITRD" -cmdline "$CMDLINE" -osrel "$OSREL" \
  -o "$WORK/uki.efi" "${policy_args[@]}"

# The ESP: FAT sized for what it holds, fixed serial and times (mtools reads
# SOURCE_DATE_EPOCH; 1980-01-02, FAT's epoch).
export SOURCE_DATE_EPOCH=315619200
files=("$WORK/uki.efi")
[ -n "${UKI_LOADER:-}" ] && files+=("$UKI_LOADER")
esp_mib=$(( ($(du -cb "${files[@]}" | tail -1 | cut -f1) >> 20) + 8 ))
truncate -s "${esp_mib}M" "$WORK/esp.img"
mformat -i "$WORK/esp.img" -N 564d4d31 -v ESP ::
mmd -i "$WORK/esp.img" ::/EFI ::/EFI/BOOT
if [ -n "${UKI_LOADER:-}" ]; then
  mmd -i "$WORK/esp.img" ::/EFI/Linux
  mcopy -i "$WORK/esp.img" "$UKI_LOADER" ::/EFI/BOOT/BOOTX64.EFI
  mcopy -i "$WORK/esp.img" "$WORK/uki.efi" "::/EFI/Linux/$STEM.efi"
else
  mcopy -i "$WORK/esp.img" "$WORK/uki.efi" ::/EFI/BOOT/BOOTX64.EFI
fi

# The disk: 1 MiB for the GPT, the ESP, 1 MiB for the backup GPT.
truncate -s "$((esp_mib + 2))M" "$WORK/disk.raw"
sfdisk --quiet "$WORK/disk.raw" <<EOF
label: gpt
label-id: 564D4D00-0000-4000-8000-000000000001
first-lba: 2048
start=2048, size=$((esp_mib * 2048)), type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, uuid=564D4D00-0000-4000-8000-000000000002, name="ESP"
EOF
dd if="$WORK/esp.img" of="$WORK/disk.raw" bs=1M seek=1 conv=notrunc status=none

for ext in efi raw policy.json; do
  src="$WORK/uki.efi"
  case "$ext" in raw) src="$WORK/disk.raw" ;; policy.json) src="$WORK/policy.json" ;; esac
  chmod 0644 "$src"
  mv -f "$src" "$OUT_DIR/$STEM.$ext"
done
echo "uki-image: $OUT_DIR/$STEM.{efi,raw,policy.json} (ESP ${esp_mib} MiB)" >&2
