// Package measure holds what the guest, the image builder and the verifier
// must agree on about a UKI boot's measurements: how systemd-stub measures a
// UKI's sections into PCR 11, the boot-phase words systemd-pcrphase extends
// after it, the PCR 13 rule for a Kubernetes system extension, and the
// userspace measurement log (systemd's tpm2-measure.log) the guest sends with
// its quotes. Only sha256 is computed: it is the one bank quotes are checked in.
package measure

import (
	"crypto/sha256"
	"fmt"
	"slices"
	"strings"
	"unicode/utf16"
)

// PCRs these measurements go to.
const (
	PCRKernelImage = 11 // UKI sections (systemd-stub) and boot phases (systemd-pcrphase)
	PCRParameters  = 12 // command-line overrides and credentials (systemd-stub)
	PCRSysext      = 13 // system extensions
	// PCRVerityRoot is where vm-agent measures the dm-verity root it
	// computed over an OCI image's root before mounting it: PCR 15, systemd's
	// PCR for what the system is (machine id, file systems, volume keys).
	PCRVerityRoot = 15
)

// Sections are the UKI sections systemd-stub measures, in the order it
// measures them: systemd 257's unified sections (.pcrsig is never
// measured). systemd 252 knows the same order without .ucode, .uname,
// .sbat, .profile, .dtbauto and .hwids; a UKI built for it has none of them
// among the sections it measures.
var Sections = []string{".linux", ".osrel", ".cmdline", ".initrd", ".ucode", ".splash", ".dtb", ".uname", ".sbat", ".pcrpkey", ".profile", ".dtbauto", ".hwids"}

// Boot phases: the words systemd-pcrphase extends into PCR 11, and the two
// phase paths quotes are checked at (contract §5.4 step 12).
const (
	WordEnterInitrd = "enter-initrd"
	WordLeaveInitrd = "leave-initrd"
	WordSysinit     = "sysinit"
	WordReady       = "ready"

	PhaseInitrd = WordEnterInitrd
	PhaseReady  = WordEnterInitrd + ":" + WordLeaveInitrd + ":" + WordSysinit + ":" + WordReady
)

// CmdlineExtraEvent is systemd-stub's PCR 12 event for a command line it
// appends from the host's SMBIOS (io.systemd.stub.kernel-cmdline-extra): the
// string as UTF-16LE with its NUL, as the stub measures load options.
func CmdlineExtraEvent(extra string) Event {
	b := make([]byte, 0, 2*len(extra)+2)
	for _, r := range utf16.Encode([]rune(extra)) {
		b = append(b, byte(r), byte(r>>8))
	}
	b = append(b, 0, 0)
	return Event{PCR: PCRParameters, Description: fmt.Sprintf("kernel command line extra %q", extra), Digest: Digest(b)}
}

// WordOSSeparator starts PCR 13 before the first system extension.
const WordOSSeparator = "os-separator"

// Extend returns sha256(pcr || digest), a TPM2_PCR_Extend of the sha256 bank.
func Extend(pcr, digest []byte) []byte {
	h := sha256.New()
	h.Write(pcr)
	h.Write(digest)
	return h.Sum(nil)
}

// Zero is a PCR's value after reset.
func Zero() []byte { return make([]byte, sha256.Size) }

// Digest is sha256(b).
func Digest(b []byte) []byte {
	d := sha256.Sum256(b)
	return d[:]
}

// Event is one expected extend of a PCR, with what it stands for.
type Event struct {
	PCR         uint32
	Description string
	Digest      []byte
}

// SectionEvents are systemd-stub's PCR 11 events for a UKI: for each section
// present, in Sections order, its name with the trailing NUL, then its
// contents. digests maps a section name to the sha256 of its contents;
// sections it lacks are not measured. A name outside Sections is an error:
// the stub would not measure it, so a policy naming it is wrong.
func SectionEvents(digests map[string][]byte) ([]Event, error) {
	for name, d := range digests {
		if !slices.Contains(Sections, name) {
			return nil, fmt.Errorf("uki section %q is not measured by systemd-stub (it measures %s)", name, strings.Join(Sections, ", "))
		}
		if len(d) != sha256.Size {
			return nil, fmt.Errorf("uki section %s: digest is %d bytes, want %d", name, len(d), sha256.Size)
		}
	}
	var out []Event
	for _, name := range Sections {
		d, ok := digests[name]
		if !ok {
			continue
		}
		out = append(out,
			Event{PCR: PCRKernelImage, Description: "uki section name " + name, Digest: Digest(append([]byte(name), 0))},
			Event{PCR: PCRKernelImage, Description: "uki section " + name, Digest: d},
		)
	}
	return out, nil
}

// PhaseWords splits a phase path ("enter-initrd:leave-initrd:…") into its
// words; the empty path has none.
func PhaseWords(path string) []string {
	if path == "" {
		return nil
	}
	return strings.Split(path, ":")
}

// WordEvent is the extend of one word (a boot phase, a separator, a
// SHA256SUMS line): sha256 of the word's bytes, no NUL, as systemd-pcrextend does.
func WordEvent(pcr uint32, word string) Event {
	return Event{PCR: pcr, Description: fmt.Sprintf("%q", word), Digest: Digest([]byte(word))}
}

// PCR11Events are the PCR 11 events of a UKI boot that has gone through the
// phase path: the stub's section events, then one event per phase word.
func PCR11Events(sectionDigests map[string][]byte, phasePath string) ([]Event, error) {
	evs, err := SectionEvents(sectionDigests)
	if err != nil {
		return nil, err
	}
	for _, w := range PhaseWords(phasePath) {
		evs = append(evs, WordEvent(PCRKernelImage, w))
	}
	return evs, nil
}

// Replay folds events into a PCR value, starting from zero.
func Replay(evs []Event) []byte {
	pcr := Zero()
	for _, e := range evs {
		pcr = Extend(pcr, e.Digest)
	}
	return pcr
}

// PCR11 is PCR 11 after the phase path, as systemd-measure calculate
// --bank=sha256 --phase=<path> prints it.
func PCR11(sectionDigests map[string][]byte, phasePath string) ([]byte, error) {
	evs, err := PCR11Events(sectionDigests, phasePath)
	if err != nil {
		return nil, err
	}
	return Replay(evs), nil
}

// SysextLine is a system extension's SHA256SUMS line, the word PCR 13 holds
// for it: "<hex sha256>  kubernetes_<version>.raw" (two spaces, as sha256sum
// writes it).
func SysextLine(sha256Hex, file string) string {
	return strings.ToLower(sha256Hex) + "  " + file
}

// SysextFile is the file name of a Kubernetes version's system extension.
func SysextFile(kubernetesVersion string) string {
	return "kubernetes_" + kubernetesVersion + ".raw"
}

// PCR13Events are the PCR 13 events for one system extension: the OS
// separator, then its SHA256SUMS line (contract §5.5, attest.SysextPCR).
func PCR13Events(line string) []Event {
	return []Event{WordEvent(PCRSysext, WordOSSeparator), WordEvent(PCRSysext, line)}
}

// PCR13 is PCR 13 after one system extension with this SHA256SUMS line.
func PCR13(line string) []byte { return Replay(PCR13Events(line)) }

// VerityRootPrefix starts the PCR 15 word of an OCI image's root.
const VerityRootPrefix = "verity-root:"

// VerityRootWord is the word vm-agent extends into PCR 15 for a root whose
// dm-verity root hash it computed: "verity-root:<lower-case hex>". It is
// the computed hash, not the one the command line asks for, so a quote of a
// changed root names what the guest found.
func VerityRootWord(rootHashHex string) string {
	return VerityRootPrefix + strings.ToLower(rootHashHex)
}

// PCR15Events are the PCR 15 events of a boot that mounted one verity root.
func PCR15Events(rootHashHex string) []Event {
	return []Event{WordEvent(PCRVerityRoot, VerityRootWord(rootHashHex))}
}

// PCR15 is PCR 15 after one verity root with this root hash.
func PCR15(rootHashHex string) []byte { return Replay(PCR15Events(rootHashHex)) }
