// Command mkuki wraps a kernel, an initramfs, a command line and an
// os-release into a unified kernel image (UKI) with systemd-stub, as systemd
// 252's objcopy recipe does, and writes the measured part of the image's
// policy: the section digests, PCR 11 per boot phase and, from the sysext
// tree's SHA256SUMS, PCR 13 per Kubernetes version.
//
// The PE header's timestamp is zeroed: objcopy writes the build time there
// (SOURCE_DATE_EPOCH is ignored), and the firmware measures the whole PE's
// Authenticode hash into PCR 4, so without this every build would need new
// golden values.
//
// With -uki it builds nothing: it writes the policy of a UKI built elsewhere
// (ukify, systemd 257's stub), from every section that stub measures.
//
// usage: mkuki -stub linuxx64.efi.stub -linux vmlinuz -initrd initrd \
//
//	-cmdline cmdline -osrel os-release -o out.efi \
//	[-policy out.policy.json -image-id ID -image-version V [-sha256sums SHA256SUMS]]
//
//	mkuki -uki built.efi [-loader systemd-bootx64.efi] -policy out.policy.json -image-id ID -image-version V [-sha256sums SHA256SUMS]
package main

import (
	"debug/pe"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"

	"github.com/giantswarm/vm-manager/pkg/measure"
)

// sectionAlign is where each added section starts: a page, as ukify does.
const sectionAlign = 0x1000

// section is one section mkuki adds, in the order systemd-stub measures them.
type section struct {
	name string
	file string
}

type config struct {
	stub, out                     string
	uki                           string // a UKI built elsewhere: policy only
	loader                        string // with uki: the boot loader in front of it (systemd-boot)
	sections                      []section
	policy, imageID, imageVersion string
	sha256sums                    string
}

func main() {
	var c config
	var linux, initrd, cmdline, osrel string
	flag.StringVar(&c.stub, "stub", "/usr/lib/systemd/boot/efi/linuxx64.efi.stub", "systemd-stub (systemd-boot-efi)")
	flag.StringVar(&linux, "linux", "", "kernel image (.linux)")
	flag.StringVar(&initrd, "initrd", "", "initramfs (.initrd)")
	flag.StringVar(&cmdline, "cmdline", "", "file holding the kernel command line (.cmdline)")
	flag.StringVar(&osrel, "osrel", "", "os-release file (.osrel)")
	flag.StringVar(&c.out, "o", "", "the UKI to write")
	flag.StringVar(&c.uki, "uki", "", "write the policy of this UKI instead of building one")
	flag.StringVar(&c.loader, "loader", "", "with -uki: the boot loader the image's disk starts first (systemd-boot)")
	flag.StringVar(&c.policy, "policy", "", "write the image policy's measured part here")
	flag.StringVar(&c.imageID, "image-id", "", "the policy's image_id")
	flag.StringVar(&c.imageVersion, "image-version", "", "the policy's image_version")
	flag.StringVar(&c.sha256sums, "sha256sums", "", "sysupdate/kubernetes/SHA256SUMS: PCR 13 per Kubernetes version")
	flag.Parse()
	// In systemd-stub's measuring order (measure.Sections).
	c.sections = []section{{".linux", linux}, {".osrel", osrel}, {".cmdline", cmdline}, {".initrd", initrd}}
	if err := run(c); err != nil {
		fmt.Fprintln(os.Stderr, "mkuki:", err)
		os.Exit(1)
	}
}

func run(c config) error {
	if c.uki != "" {
		return policyOf(c)
	}
	if c.out == "" {
		return errors.New("-o is required")
	}
	for _, s := range c.sections {
		if s.file == "" {
			return fmt.Errorf("no file for section %s", s.name)
		}
	}
	digests, err := build(c)
	if err != nil {
		return err
	}
	if c.policy == "" {
		return nil
	}
	apps, err := applications(c)
	if err != nil {
		return err
	}
	return writePolicy(c, digests, apps)
}

func writePolicy(c config, digests map[string][]byte, apps map[string]string) error {
	doc, err := policy(c, digests, apps)
	if err != nil {
		return err
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	return writeAtomic(c.policy, append(b, '\n'))
}

// build writes the UKI and returns the sha256 of each section's contents,
// read back from the written PE.
func build(c config) (map[string][]byte, error) {
	stub, err := pe.Open(c.stub)
	if err != nil {
		return nil, fmt.Errorf("stub %s: %w", c.stub, err)
	}
	base, next := uint64(0), uint64(0)
	if oh, ok := stub.OptionalHeader.(*pe.OptionalHeader64); ok {
		base = oh.ImageBase
	}
	for _, s := range stub.Sections {
		if slices.ContainsFunc(c.sections, func(a section) bool { return a.name == s.Name }) {
			stub.Close()
			return nil, fmt.Errorf("stub %s already has a %s section", c.stub, s.Name)
		}
		next = max(next, uint64(s.VirtualAddress)+uint64(max(s.VirtualSize, s.Size)))
	}
	stub.Close()

	tmp := c.out + ".tmp"
	defer os.Remove(tmp)
	args := []string{}
	sizes := map[string]int64{}
	for _, s := range c.sections {
		fi, err := os.Stat(s.file)
		if err != nil {
			return nil, err
		}
		if fi.Size() == 0 {
			return nil, fmt.Errorf("section %s: %s is empty", s.name, s.file)
		}
		next = alignUp(next, sectionAlign)
		args = append(args,
			"--add-section", s.name+"="+s.file,
			"--change-section-vma", fmt.Sprintf("%s=%#x", s.name, base+next))
		sizes[s.name] = fi.Size()
		next += uint64(fi.Size())
	}
	args = append(args, c.stub, tmp)
	if out, err := exec.Command("objcopy", args...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("objcopy: %v\n%s", err, out)
	}
	if err := zeroTimestamp(tmp); err != nil {
		return nil, err
	}
	digests, err := sectionDigests(tmp, sizes)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		return nil, err
	}
	return digests, os.Rename(tmp, c.out)
}

func alignUp(v, a uint64) uint64 { return (v + a - 1) &^ (a - 1) }

// zeroTimestamp clears the COFF header's TimeDateStamp, and the optional
// header's CheckSum, which objcopy computed over that timestamp (0 means
// "not computed"; UEFI does not check it).
func zeroTimestamp(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	var hdr [4]byte
	if _, err := f.ReadAt(hdr[:], 0x3c); err != nil {
		return err
	}
	peOff := int64(binary.LittleEndian.Uint32(hdr[:]))
	var sig [4]byte
	if _, err := f.ReadAt(sig[:], peOff); err != nil {
		return err
	}
	if string(sig[:]) != "PE\x00\x00" {
		return fmt.Errorf("%s: no PE signature at %#x", path, peOff)
	}
	// Signature (4), Machine (2), NumberOfSections (2), then TimeDateStamp;
	// the optional header follows the 20-byte COFF header, CheckSum at 64.
	for _, off := range []int64{peOff + 8, peOff + 4 + 20 + 64} {
		if _, err := f.WriteAt(make([]byte, 4), off); err != nil {
			return err
		}
	}
	return f.Close()
}

// sectionDigests reads the added sections back from the PE, checks their
// sizes, and hashes what systemd-stub measures: VirtualSize bytes of each.
func sectionDigests(path string, sizes map[string]int64) (map[string][]byte, error) {
	f, err := pe.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string][]byte{}
	for name, size := range sizes {
		s := f.Section(name)
		if s == nil {
			return nil, fmt.Errorf("%s: objcopy wrote no %s section", path, name)
		}
		if int64(s.VirtualSize) != size || int64(s.Size) < size {
			return nil, fmt.Errorf("%s: section %s is %d bytes (%d in the file), want %d", path, name, s.VirtualSize, s.Size, size)
		}
		b, err := s.Data()
		if err != nil {
			return nil, err
		}
		out[name] = measure.Digest(b[:size])
	}
	return out, nil
}

// policy is the measured part of the image's policy.json (contract §5.5):
// what systemd-stub and the boot phases put into PCR 11, and what each
// Kubernetes system extension puts into PCR 13.
func policy(c config, digests map[string][]byte, apps map[string]string) (map[string]any, error) {
	if c.imageID == "" || c.imageVersion == "" {
		return nil, errors.New("-policy needs -image-id and -image-version")
	}
	sections := map[string]string{}
	for name, d := range digests {
		sections[name] = hex.EncodeToString(d)
	}
	pcr11 := map[string]string{}
	for _, phase := range []string{measure.PhaseInitrd, measure.PhaseReady} {
		v, err := measure.PCR11(digests, phase)
		if err != nil {
			return nil, err
		}
		pcr11[phase] = hex.EncodeToString(v)
	}
	doc := map[string]any{
		"image_id":      c.imageID,
		"image_version": c.imageVersion,
		"uki":           map[string]any{"sections": sections, "authenticode": apps},
		"pcr11":         pcr11,
	}
	if c.sha256sums != "" {
		sysext, pcr13, err := kubernetes(c.sha256sums)
		if err != nil {
			return nil, err
		}
		if len(sysext) > 0 {
			doc["sysext"], doc["pcr13"] = sysext, pcr13
		}
	}
	return doc, nil
}

// applications are the Authenticode hashes of the EFI applications a boot
// of the UKI starts, which the firmware measures into PCR 4: the UKI, then
// the kernel systemd-stub loads from its .linux section. Any other
// application in PCR 4 is not the image's.
func applications(c config) (map[string]string, error) {
	out := map[string]string{}
	for key, path := range map[string]string{"uki": c.out, "linux": c.sections[0].file} {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		d, err := measure.Authenticode(b)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		out[key] = hex.EncodeToString(d)
	}
	return out, nil
}

func writeAtomic(path string, b []byte) error {
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
