#!/bin/bash
# Replaces Debian's kernel-network-modules dracut module in the vm-base build: a
# VM's only NIC is virtio-net. Without hostonly, Debian's module installs every
# wired driver, bridge, bonding and team (1.8 MB of the compressed initrd).

check() { return 255; }

installkernel() {
    hostonly='' instmods virtio_net af_packet
}
