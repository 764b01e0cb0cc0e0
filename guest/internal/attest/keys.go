package attest

import (
	"errors"
	"fmt"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/giantswarm/vm-manager/pkg/vtpm"
)

// Persistent handles (contract §5.3), as the host provisions them.
const (
	AKHandle = vtpm.AKHandle
	EKHandle = vtpm.EKHandle
)

// ErrForeignAK means AKHandle holds a key that is not an AK of vm-agent's
// template. It is never overwritten: the host provisions that handle.
var ErrForeignAK = errors.New("foreign key at the attestation key handle")

// AKTemplate is the AK's template, shared with the host that provisions it.
func AKTemplate() tpm2.TPMTPublic { return vtpm.AKTemplate() }

// AK is the loaded attestation key.
type AK struct {
	Handle tpm2.TPMHandle
	Name   tpm2.TPM2BName
	Public []byte // TPMT_PUBLIC as the TPM returned it
}

// LoadOrCreateAK returns the AK persisted at AKHandle. The host provisions
// it before the VM's first boot; on a TPM it did not provision (a test swtpm,
// a machine of its own) vm-agent creates it under a transient ECC SRK.
func LoadOrCreateAK(t transport.TPM) (*AK, error) {
	ak, err := readAK(t)
	if err == nil || !vtpm.IsEmptyHandle(err) {
		return ak, err
	}
	if err := vtpm.CreateAK(t); err != nil {
		return nil, err
	}
	return readAK(t)
}

func readAK(t transport.TPM) (*AK, error) {
	k, err := vtpm.ReadKey(t, AKHandle)
	if err != nil {
		return nil, err
	}
	if !matchesTemplate(k.Parsed, AKTemplate()) {
		return nil, fmt.Errorf("%w: handle %#x holds a key (%s, %s) that does not match vm-agent's AK template; refusing to use or overwrite it (evict it to let vm-agent create its AK)",
			ErrForeignAK, uint32(AKHandle), vtpm.AlgName(k.Parsed.Type), attrString(k.Parsed.ObjectAttributes))
	}
	return &AK{Handle: AKHandle, Name: k.Name, Public: k.Public}, nil
}

func matchesTemplate(pub, tmpl tpm2.TPMTPublic) bool { return vtpm.MatchesTemplate(pub, tmpl) }

// EKPublic returns the TPMT_PUBLIC of the EK at EKHandle, else of the RSA-2048 EK
// derived from the TCG template (deterministic, so the same key every time).
func EKPublic(t transport.TPM) ([]byte, error) {
	if rsp, err := (tpm2.ReadPublic{ObjectHandle: EKHandle}).Execute(t); err == nil {
		return rsp.OutPublic.Bytes(), nil
	}
	ek, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.TPMRHEndorsement,
		InPublic:      tpm2.New2B(vtpm.EKTemplate()),
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("deriving the RSA EK: %w", err)
	}
	flush(t, ek.ObjectHandle)
	return ek.OutPublic.Bytes(), nil
}

func attrString(a tpm2.TPMAObject) string {
	var s []string
	for _, f := range []struct {
		set  bool
		name string
	}{
		{a.FixedTPM, "fixedTPM"}, {a.STClear, "stClear"}, {a.FixedParent, "fixedParent"},
		{a.SensitiveDataOrigin, "sensitiveDataOrigin"}, {a.UserWithAuth, "userWithAuth"},
		{a.AdminWithPolicy, "adminWithPolicy"}, {a.NoDA, "noDA"},
		{a.EncryptedDuplication, "encryptedDuplication"}, {a.Restricted, "restricted"},
		{a.Decrypt, "decrypt"}, {a.SignEncrypt, "sign"},
	} {
		if f.set {
			s = append(s, f.name)
		}
	}
	if len(s) == 0 {
		return "(none)"
	}
	return fmt.Sprint(s)
}
