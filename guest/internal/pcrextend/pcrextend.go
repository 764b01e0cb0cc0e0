// Package pcrextend extends words into TPM PCRs as systemd-pcrphase and
// systemd-pcrextend do (every allocated bank gets its own hash of the word)
// and appends each extend to the userspace measurement log that goes with
// quotes (pkg/measure's tpm2-measure.log format). It also tells whether the
// boot went through systemd-stub, the only case in which boot phases are
// extended.
package pcrextend

import (
	"crypto"
	_ "crypto/sha1" // the hashes of the banks a TPM may allocate
	_ "crypto/sha256"
	_ "crypto/sha512"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"golang.org/x/sys/unix"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/pkg/measure"
)

// EFIVarsDir is where efivarfs is mounted.
const EFIVarsDir = "/sys/firmware/efi/efivars"

// StubVariable is the EFI variable systemd-stub (252: `strings -el
// linuxx64.efi.stub`) sets to the PCR it measured the UKI into, under the
// loader vendor GUID. Its presence is how the initrd knows the stub ran.
const StubVariable = "StubPcrKernelImage-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"

// BootIDPath holds the kernel's boot id (a UUID with dashes).
const BootIDPath = "/proc/sys/kernel/random/boot_id"

// StubBooted reports whether efivars (EFIVarsDir at boot) holds StubVariable.
func StubBooted(efivars string) bool {
	_, err := os.Stat(filepath.Join(efivars, StubVariable))
	return err == nil
}

// MountEFIVars mounts efivarfs at EFIVarsDir. Without /sys/firmware/efi the
// machine did not boot through UEFI: there is nothing to mount and no stub.
func MountEFIVars() error {
	if _, err := os.Stat(filepath.Dir(EFIVarsDir)); err != nil {
		return fmt.Errorf("not an EFI boot: %w", err)
	}
	err := unix.Mount("efivarfs", EFIVarsDir, "efivarfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC|unix.MS_RDONLY, "")
	if err != nil && err != unix.EBUSY {
		return fmt.Errorf("mount efivarfs on %s: %w", EFIVarsDir, err)
	}
	return nil
}

// BootID is the boot id as systemd writes it into log records: 32 hex
// digits, no dashes.
func BootID(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.ReplaceAll(strings.TrimSpace(string(b)), "-", "")
}

// MonotonicUsec is CLOCK_MONOTONIC in µs, systemd's record timestamp.
func MonotonicUsec() uint64 {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) != nil {
		return 0
	}
	return uint64(ts.Sec)*1e6 + uint64(ts.Nsec)/1e3
}

// bankHashes are the banks a word can be hashed for, with systemd's names.
var bankHashes = map[tpm2.TPMAlgID]struct {
	name string
	hash crypto.Hash
}{
	tpm2.TPMAlgSHA1:   {"sha1", crypto.SHA1},
	tpm2.TPMAlgSHA256: {"sha256", crypto.SHA256},
	tpm2.TPMAlgSHA384: {"sha384", crypto.SHA384},
	tpm2.TPMAlgSHA512: {"sha512", crypto.SHA512},
}

// Extender extends words into PCRs and logs them.
type Extender struct {
	TPMPath string // attest.DefaultTPMPath at boot, a swtpm socket in tests
	LogPath string // measure.DefaultLogPath at boot
	BootID  string
	Now     func() uint64 // µs for the record; MonotonicUsec when nil
}

// New is the boot configuration.
func New() *Extender {
	return &Extender{TPMPath: attest.DefaultTPMPath, LogPath: measure.DefaultLogPath, BootID: BootID(BootIDPath)}
}

// Extend extends word (its bytes, no NUL) into pcr in every allocated bank
// whose hash is known, then appends the record. It returns the banks
// extended. A failed extend writes no record, so the log replays to the PCR.
func (e *Extender) Extend(pcr uint32, word, eventType string) ([]string, error) {
	t, err := attest.OpenTPM(e.TPMPath)
	if err != nil {
		return nil, fmt.Errorf("opening the TPM: %w", err)
	}
	defer t.Close()
	algs, err := allocatedBanks(t, pcr)
	if err != nil {
		return nil, err
	}
	var digests tpm2.TPMLDigestValues
	var recDigests []measure.RecordDigest
	var names []string
	for _, alg := range algs {
		b, ok := bankHashes[alg]
		if !ok {
			continue // e.g. SM3: no hash for it here; its bank is left alone
		}
		h := b.hash.New()
		h.Write([]byte(word))
		d := h.Sum(nil)
		digests.Digests = append(digests.Digests, tpm2.TPMTHA{HashAlg: alg, Digest: d})
		recDigests = append(recDigests, measure.RecordDigest{HashAlg: b.name, Digest: hex.EncodeToString(d)})
		names = append(names, b.name)
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("PCR %d: no allocated bank with a known hash", pcr)
	}
	_, err = tpm2.PCRExtend{
		PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(pcr), Auth: tpm2.PasswordAuth(nil)},
		Digests:   digests,
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("TPM2_PCR_Extend(%d): %w", pcr, err)
	}
	now := e.Now
	if now == nil {
		now = MonotonicUsec
	}
	rec := measure.WordRecord(pcr, word, eventType, e.BootID, now())
	rec.Digests = recDigests // every bank extended, as systemd logs them
	if err := e.appendRecord(rec); err != nil {
		return names, fmt.Errorf("PCR %d extended, but not logged: %w", pcr, err)
	}
	return names, nil
}

func (e *Extender) appendRecord(r measure.Record) error {
	if err := os.MkdirAll(filepath.Dir(e.LogPath), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(e.LogPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	if err := measure.WriteRecord(f, r); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// allocatedBanks are the banks in which pcr is allocated.
func allocatedBanks(t transport.TPM, pcr uint32) ([]tpm2.TPMAlgID, error) {
	rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapPCRs, PropertyCount: 1}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("reading the PCR banks: %w", err)
	}
	sel, err := rsp.CapabilityData.Data.AssignedPCR()
	if err != nil {
		return nil, fmt.Errorf("reading the PCR banks: %w", err)
	}
	var out []tpm2.TPMAlgID
	for _, s := range sel.PCRSelections {
		if i := pcr / 8; int(i) < len(s.PCRSelect) && s.PCRSelect[i]&(1<<(pcr%8)) != 0 {
			out = append(out, s.Hash)
		}
	}
	return out, nil
}
