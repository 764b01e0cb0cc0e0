package attest

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// Persistent handles (contract §5.3; 0x81010001 is the TCG's EK handle).
const (
	AKHandle tpm2.TPMHandle = 0x81010002
	EKHandle tpm2.TPMHandle = 0x81010001
)

// ErrForeignAK means AKHandle holds a key vm-agent did not make. It is never
// overwritten: it may be somebody's enrolled key.
var ErrForeignAK = errors.New("foreign key at the attestation key handle")

// AKTemplate is go-tpm-tools' client.AKTemplateECC plus noDA (a test keeps the two in
// step): a restricted ECC P-256 ECDSA-SHA256 signing key. Unique is empty because
// TPM2_Create generates the key.
func AKTemplate() tpm2.TPMTPublic {
	return tpm2.TPMTPublic{
		Type:    tpm2.TPMAlgECC,
		NameAlg: tpm2.TPMAlgSHA256,
		ObjectAttributes: tpm2.TPMAObject{
			FixedTPM:            true,
			FixedParent:         true,
			SensitiveDataOrigin: true,
			UserWithAuth:        true,
			NoDA:                true,
			Restricted:          true,
			SignEncrypt:         true,
		},
		Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgECC, &tpm2.TPMSECCParms{
			Symmetric: tpm2.TPMTSymDefObject{Algorithm: tpm2.TPMAlgNull},
			Scheme: tpm2.TPMTECCScheme{
				Scheme:  tpm2.TPMAlgECDSA,
				Details: tpm2.NewTPMUAsymScheme(tpm2.TPMAlgECDSA, &tpm2.TPMSSigSchemeECDSA{HashAlg: tpm2.TPMAlgSHA256}),
			},
			CurveID: tpm2.TPMECCNistP256,
			KDF:     tpm2.TPMTKDFScheme{Scheme: tpm2.TPMAlgNull},
		}),
		Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{}),
	}
}

// AK is the loaded attestation key.
type AK struct {
	Handle tpm2.TPMHandle
	Name   tpm2.TPM2BName
	Public []byte // TPMT_PUBLIC as the TPM returned it
}

// LoadOrCreateAK returns the AK persisted at AKHandle. If the handle is empty it
// creates the AK under a transient ECC SRK and persists it there.
func LoadOrCreateAK(t transport.TPM) (*AK, error) {
	ak, err := readAK(t)
	if err == nil || !errors.Is(err, tpm2.TPMRCHandle) {
		return ak, err
	}
	if err := createAK(t); err != nil {
		return nil, fmt.Errorf("creating the attestation key: %w", err)
	}
	return readAK(t)
}

func readAK(t transport.TPM) (*AK, error) {
	rsp, err := tpm2.ReadPublic{ObjectHandle: AKHandle}.Execute(t)
	if err != nil {
		return nil, err
	}
	pub, err := rsp.OutPublic.Contents()
	if err != nil {
		return nil, fmt.Errorf("attestation key at %#x: %w", uint32(AKHandle), err)
	}
	if !matchesTemplate(*pub, AKTemplate()) {
		return nil, fmt.Errorf("%w: handle %#x holds a key (%s, %s) that does not match vm-agent's AK template; refusing to use or overwrite it (evict it to let vm-agent create its AK)",
			ErrForeignAK, uint32(AKHandle), algName(pub.Type), attrString(pub.ObjectAttributes))
	}
	return &AK{Handle: AKHandle, Name: rsp.Name, Public: rsp.OutPublic.Bytes()}, nil
}

// matchesTemplate compares everything but the unique field (the key itself).
func matchesTemplate(pub, tmpl tpm2.TPMTPublic) bool {
	pub.Unique = tmpl.Unique
	return bytes.Equal(tpm2.Marshal(pub), tpm2.Marshal(tmpl))
}

func createAK(t transport.TPM) error {
	srk, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.TPMRHOwner,
		InPublic:      tpm2.New2B(tpm2.ECCSRKTemplate),
	}.Execute(t)
	if err != nil {
		return fmt.Errorf("creating the ECC SRK: %w", err)
	}
	defer flush(t, srk.ObjectHandle)
	parent := tpm2.AuthHandle{Handle: srk.ObjectHandle, Name: srk.Name, Auth: tpm2.PasswordAuth(nil)}
	created, err := tpm2.Create{ParentHandle: parent, InPublic: tpm2.New2B(AKTemplate())}.Execute(t)
	if err != nil {
		return err
	}
	loaded, err := tpm2.Load{ParentHandle: parent, InPrivate: created.OutPrivate, InPublic: created.OutPublic}.Execute(t)
	if err != nil {
		return err
	}
	defer flush(t, loaded.ObjectHandle)
	_, err = tpm2.EvictControl{
		Auth:             tpm2.TPMRHOwner,
		ObjectHandle:     tpm2.NamedHandle{Handle: loaded.ObjectHandle, Name: loaded.Name},
		PersistentHandle: AKHandle,
	}.Execute(t)
	if err != nil {
		return fmt.Errorf("persisting at %#x: %w", uint32(AKHandle), err)
	}
	return nil
}

// EKPublic returns the TPMT_PUBLIC of the EK at EKHandle, else of the RSA-2048 EK
// derived from the TCG template (deterministic, so the same key every time).
func EKPublic(t transport.TPM) ([]byte, error) {
	if rsp, err := (tpm2.ReadPublic{ObjectHandle: EKHandle}).Execute(t); err == nil {
		return rsp.OutPublic.Bytes(), nil
	}
	ek, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.TPMRHEndorsement,
		InPublic:      tpm2.New2B(tpm2.RSAEKTemplate),
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("deriving the RSA EK: %w", err)
	}
	flush(t, ek.ObjectHandle)
	return ek.OutPublic.Bytes(), nil
}

func algName(a tpm2.TPMAlgID) string {
	switch a {
	case tpm2.TPMAlgRSA:
		return "RSA"
	case tpm2.TPMAlgECC:
		return "ECC"
	case tpm2.TPMAlgKeyedHash:
		return "keyed-hash"
	case tpm2.TPMAlgSymCipher:
		return "symmetric"
	}
	return fmt.Sprintf("alg %#x", uint16(a))
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
