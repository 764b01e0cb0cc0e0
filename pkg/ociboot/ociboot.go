// Package ociboot is what the hypervisor and vm-agent agree on to boot an
// imported OCI image: the command-line words that carry its dm-verity root,
// the serials of the disks it is attached on, and the layout of its root
// (an erofs holding the image's file system and the config that says what
// to run). The root hash is on the measured command line (PCR 9), and
// vm-agent measures the root hash it computed into PCR 15, so a quote names
// the image's content, config included.
package ociboot

import (
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
)

// Command-line words: vmm.oci.roothash=<hex> vmm.oci.salt=<hex>
// vmm.oci.datablocks=<n>. Their presence makes vm-agent boot the image.
const (
	KeyRootHash   = "vmm.oci.roothash"
	KeySalt       = "vmm.oci.salt"
	KeyDataBlocks = "vmm.oci.datablocks"
)

// Disk serials (/dev/disk/by-id/virtio-<serial>): the erofs root and its
// verity hash device, both read-only; the VM's own writable disk holds the
// overlay's upper directory.
const (
	SerialRoot   = "oci-root"
	SerialVerity = "oci-verity"
	SerialUpper  = "target"
)

// The erofs root's layout: the image's flattened file system under
// RootfsDir, and ConfigFile beside it.
const (
	RootfsDir  = "rootfs"
	ConfigFile = "image.json"
)

// Verity parameters of the hash device (pkg/verity): format 1, sha256, 4 KiB
// blocks, the superblock in the hash device's first block.
const (
	BlockSize      = 4096
	HashStartBlock = 1
	HashAlgorithm  = "sha256"
)

// Config is ConfigFile: where the root came from and what the VM runs.
type Config struct {
	ManifestDigest string   `json:"manifestDigest"`
	ConfigDigest   string   `json:"configDigest"`
	Entrypoint     []string `json:"entrypoint,omitempty"`
	Cmd            []string `json:"cmd,omitempty"`
	Env            []string `json:"env,omitempty"`
	WorkingDir     string   `json:"workingDir,omitempty"`
	User           string   `json:"user,omitempty"`
}

// Root is the verity root a command line names.
type Root struct {
	RootHash   []byte
	Salt       []byte
	DataBlocks uint64
}

// Cmdline is the words to append to the boot chain's command line.
func (r Root) Cmdline() string {
	return fmt.Sprintf("%s=%x %s=%x %s=%d", KeyRootHash, r.RootHash, KeySalt, r.Salt, KeyDataBlocks, r.DataBlocks)
}

// Table is the dm-verity target line for a data device of r.DataBlocks
// blocks and its hash device (device paths or major:minor).
func (r Root) Table(data, hash string) string {
	return fmt.Sprintf("verity 1 %s %s %d %d %d %d %s %x %x", data, hash, BlockSize, BlockSize,
		r.DataBlocks, HashStartBlock, HashAlgorithm, r.RootHash, r.Salt)
}

// Sectors is the data device's length in 512-byte sectors.
func (r Root) Sectors() uint64 { return r.DataBlocks * (BlockSize / 512) }

// ParseCmdline reads the root from a kernel command line; ok is false when
// the command line names none. A partial or malformed one is an error: the
// guest must not boot something else in its place.
func ParseCmdline(cmdline string) (r Root, ok bool, err error) {
	var seen int
	for _, w := range strings.Fields(cmdline) {
		k, v, _ := strings.Cut(w, "=")
		switch k {
		case KeyRootHash:
			seen++
			if r.RootHash, err = hex.DecodeString(v); err != nil || len(r.RootHash) != 32 {
				return r, true, fmt.Errorf("%s: not 32 bytes of hex", KeyRootHash)
			}
		case KeySalt:
			seen++
			if r.Salt, err = hex.DecodeString(v); err != nil || len(r.Salt) > 256 {
				return r, true, fmt.Errorf("%s: not at most 256 bytes of hex", KeySalt)
			}
		case KeyDataBlocks:
			seen++
			if r.DataBlocks, err = strconv.ParseUint(v, 10, 64); err != nil || r.DataBlocks == 0 {
				return r, true, fmt.Errorf("%s: not a positive number", KeyDataBlocks)
			}
		}
	}
	switch seen {
	case 0:
		return Root{}, false, nil
	case 3:
		return r, true, nil
	}
	return r, true, fmt.Errorf("the command line names an OCI root partly: it needs %s, %s and %s once each", KeyRootHash, KeySalt, KeyDataBlocks)
}
