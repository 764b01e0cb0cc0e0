# mmdebstrap --setup-hook: the kernel's postinst builds an initrd while the
# tree is bootstrapped; hack/os-image.sh throws it away and builds its own, so
# this one is uncompressed (fast).
mkdir -p "$1/etc/dracut.conf.d"
printf 'compress="cat"\nhostonly="no"\n' >"$1/etc/dracut.conf.d/00-vmm-build.conf"
