#!/bin/bash
# Replaces Debian's tpm2-tss dracut module in the vm-base build: the initrd needs
# only what systemd-pcrextend dlopens (ESAPI and the device TCTI); vm-agent talks
# to /dev/tpmrm0 itself. Debian's module also installs tpm2-tools and FAPI, and
# with them curl, GnuTLS and Kerberos: about 5 MB of the compressed initrd, which
# every boot hashes and unpacks under emulation.

check() { return 255; }

depends() {
    echo systemd-sysusers systemd-udevd
}

installkernel() {
    instmods '=drivers/char/tpm'
}

install() {
    inst_sysusers tpm2-tss.conf
    inst_multiple -o \
        "$udevrulesdir"/60-tpm-udev.rules \
        "$systemdutildir"/system-generators/systemd-tpm2-generator \
        "$systemdsystemunitdir/tpm2.target"
    local lib
    for lib in libtss2-esys.so.0 libtss2-sys.so.1 libtss2-mu.so.0 libtss2-rc.so.0 libtss2-tctildr.so.0 libtss2-tcti-device.so.0; do
        inst_libdir_file "$lib"
    done
}
