#!/bin/bash
# vm-manager's part of the vm-base initrd: the installer boot, the
# initrd-stage quote that releases user-data, the var partition and the
# persistent /etc that Ignition writes into.

check() { return 0; }

depends() {
    echo systemd systemd-networkd systemd-veritysetup systemd-pcrphase tpm2-tss ignition
}

installkernel() {
    hostonly='' instmods overlay ext4
}

install() {
    inst_multiple mkdir mount
    inst_simple /usr/bin/vm-agent /usr/bin/vm-agent
    local u
    for u in vmm-install.service vmm-attest-initrd.service vmm-etc-overlay.service sysroot-var.mount; do
        inst_simple "$moddir/$u" "$systemdsystemunitdir/$u"
    done
    mkdir -p "$initdir$systemdsystemunitdir/initrd-root-device.target.wants" \
             "$initdir$systemdsystemunitdir/initrd.target.wants" \
             "$initdir$systemdsystemunitdir/initrd-fs.target.wants" \
             "$initdir$systemdsystemunitdir/ignition-remount-sysroot.service.d" \
             "$initdir$systemdsystemunitdir/ignition-files.service.d" \
             "$initdir$systemdsystemunitdir/ignition-fetch.service.d"
    ln_r "$systemdsystemunitdir/vmm-install.service" "$systemdsystemunitdir/initrd-root-device.target.wants/vmm-install.service"
    ln_r "$systemdsystemunitdir/vmm-attest-initrd.service" "$systemdsystemunitdir/initrd.target.wants/vmm-attest-initrd.service"
    ln_r "$systemdsystemunitdir/sysroot-var.mount" "$systemdsystemunitdir/initrd-fs.target.wants/sysroot-var.mount"
    ln_r "$systemdsystemunitdir/vmm-etc-overlay.service" "$systemdsystemunitdir/initrd-fs.target.wants/vmm-etc-overlay.service"
    inst_simple "$moddir/ignition-remount-sysroot.conf" "$systemdsystemunitdir/ignition-remount-sysroot.service.d/vmm.conf"
    inst_simple "$moddir/ignition-files.conf" "$systemdsystemunitdir/ignition-files.service.d/vmm.conf"
    inst_simple "$moddir/ignition-fetch.conf" "$systemdsystemunitdir/ignition-fetch.service.d/vmm.conf"
    # dracut's shell hooks (cmdline, pre-udev, initqueue) cost about 3 s of each
    # boot under TCG and do nothing systemd's generators don't do here: root= and
    # roothash= (fstab and veritysetup generators), ip=dhcp
    # (systemd-network-generator), dm-mod (loaded on first use). Masked. The one
    # effect that matters, waiting for the network, comes from wait-online.conf.
    mkdir -p "$initdir/etc/systemd/system" "$initdir$systemdsystemunitdir/systemd-networkd-wait-online.service.d"
    for u in dracut-cmdline.service dracut-pre-udev.service dracut-initqueue.service; do
        ln -sf /dev/null "$initdir/etc/systemd/system/$u"
    done
    inst_simple "$moddir/wait-online.conf" "$systemdsystemunitdir/systemd-networkd-wait-online.service.d/99-vmm.conf"
}
