// Package vtpm is what the host and the guest agree about a VM's vTPM: the
// persistent handles, the attestation key's template and how it is made, the
// key fingerprint verdicts name, and the framing of swtpm's socket. One
// definition for the hypervisor, which provisions the keys before the guest
// first runs, for vm-agent, which quotes with them, and for attestation,
// which names them.
package vtpm

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// Persistent handles (contract §5.3). 0x81010001 is the TCG's RSA EK handle;
// 0x81010002 is where the original's agent, and vm-agent, keep the AK.
const (
	EKHandle tpm2.TPMHandle = 0x81010001
	AKHandle tpm2.TPMHandle = 0x81010002
	// EKCertIndex is the TCG's NV index of the RSA-2048 EK certificate.
	EKCertIndex tpm2.TPMHandle = 0x01c00002
)

// AKTemplate is go-tpm-tools' client.AKTemplateECC plus noDA (a test keeps
// the two in step): a restricted ECC P-256 ECDSA-SHA256 signing key. Unique
// is empty because TPM2_Create generates the key.
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

// EKTemplate is the TCG's default RSA-2048 EK template (EK Credential
// Profile, template L-1): CreatePrimary derives the same key from the
// endorsement seed every time.
func EKTemplate() tpm2.TPMTPublic { return tpm2.RSAEKTemplate }

// MatchesTemplate compares everything but the unique field (the key itself).
func MatchesTemplate(pub, tmpl tpm2.TPMTPublic) bool {
	pub.Unique = tmpl.Unique
	return bytes.Equal(tpm2.Marshal(pub), tpm2.Marshal(tmpl))
}

// Fingerprint is the hex SHA-256 of a key's TPMT_PUBLIC (contract §5.4): how
// verdicts, VM records and attestation name a key.
func Fingerprint(tpmtPublic []byte) string {
	sum := sha256.Sum256(tpmtPublic)
	return hex.EncodeToString(sum[:])
}

// Key is a persistent key as the TPM reports it.
type Key struct {
	Handle tpm2.TPMHandle
	Name   tpm2.TPM2BName
	// Public is the TPMT_PUBLIC (no size prefix).
	Public []byte
	Parsed tpm2.TPMTPublic
}

// ReadKey reads the key at a persistent handle. An empty handle is an error
// that wraps tpm2.TPMRCHandle.
func ReadKey(t transport.TPM, h tpm2.TPMHandle) (*Key, error) {
	rsp, err := tpm2.ReadPublic{ObjectHandle: h}.Execute(t)
	if err != nil {
		return nil, err
	}
	pub, err := rsp.OutPublic.Contents()
	if err != nil {
		return nil, fmt.Errorf("key at %#x: %w", uint32(h), err)
	}
	return &Key{Handle: h, Name: rsp.Name, Public: rsp.OutPublic.Bytes(), Parsed: *pub}, nil
}

// IsEmptyHandle reports whether err says a handle holds no object.
func IsEmptyHandle(err error) bool { return errors.Is(err, tpm2.TPMRCHandle) }

// CreateAK creates an AK from AKTemplate under a transient ECC SRK and
// persists it at AKHandle, which must be empty.
func CreateAK(t transport.TPM) error {
	srk, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.TPMRHOwner,
		InPublic:      tpm2.New2B(tpm2.ECCSRKTemplate),
	}.Execute(t)
	if err != nil {
		return fmt.Errorf("creating the ECC SRK: %w", err)
	}
	defer Flush(t, srk.ObjectHandle)
	parent := tpm2.AuthHandle{Handle: srk.ObjectHandle, Name: srk.Name, Auth: tpm2.PasswordAuth(nil)}
	created, err := tpm2.Create{ParentHandle: parent, InPublic: tpm2.New2B(AKTemplate())}.Execute(t)
	if err != nil {
		return fmt.Errorf("creating the attestation key: %w", err)
	}
	loaded, err := tpm2.Load{ParentHandle: parent, InPrivate: created.OutPrivate, InPublic: created.OutPublic}.Execute(t)
	if err != nil {
		return fmt.Errorf("loading the attestation key: %w", err)
	}
	defer Flush(t, loaded.ObjectHandle)
	return persist(t, loaded.ObjectHandle, loaded.Name, AKHandle)
}

// PersistEK derives the EK from EKTemplate and persists it at EKHandle,
// which must be empty.
func PersistEK(t transport.TPM) error {
	ek, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.TPMRHEndorsement,
		InPublic:      tpm2.New2B(EKTemplate()),
	}.Execute(t)
	if err != nil {
		return fmt.Errorf("deriving the RSA EK: %w", err)
	}
	defer Flush(t, ek.ObjectHandle)
	return persist(t, ek.ObjectHandle, ek.Name, EKHandle)
}

func persist(t transport.TPM, h tpm2.TPMHandle, name tpm2.TPM2BName, at tpm2.TPMHandle) error {
	_, err := tpm2.EvictControl{
		Auth:             tpm2.TPMRHOwner,
		ObjectHandle:     tpm2.NamedHandle{Handle: h, Name: name},
		PersistentHandle: at,
	}.Execute(t)
	if err != nil {
		return fmt.Errorf("persisting at %#x: %w", uint32(at), err)
	}
	return nil
}

// Evict removes the persistent key k.
func Evict(t transport.TPM, k *Key) error {
	_, err := tpm2.EvictControl{
		Auth:             tpm2.TPMRHOwner,
		ObjectHandle:     tpm2.NamedHandle{Handle: k.Handle, Name: k.Name},
		PersistentHandle: k.Handle,
	}.Execute(t)
	if err != nil {
		return fmt.Errorf("evicting %#x: %w", uint32(k.Handle), err)
	}
	return nil
}

// AlgName is a TPM algorithm's name, lower-case, for messages: "ecc",
// "sha256"; an unknown one is its number in hex.
func AlgName(a tpm2.TPMAlgID) string {
	switch a {
	case tpm2.TPMAlgSHA1:
		return "sha1"
	case tpm2.TPMAlgSHA256:
		return "sha256"
	case tpm2.TPMAlgSHA384:
		return "sha384"
	case tpm2.TPMAlgSHA512:
		return "sha512"
	case tpm2.TPMAlgSM3256:
		return "sm3_256"
	case tpm2.TPMAlgRSA:
		return "rsa"
	case tpm2.TPMAlgECC:
		return "ecc"
	case tpm2.TPMAlgKeyedHash:
		return "keyedhash"
	case tpm2.TPMAlgSymCipher:
		return "symcipher"
	case tpm2.TPMAlgRSASSA:
		return "rsassa"
	case tpm2.TPMAlgRSAPSS:
		return "rsapss"
	case tpm2.TPMAlgECDSA:
		return "ecdsa"
	case tpm2.TPMAlgECDAA:
		return "ecdaa"
	case tpm2.TPMAlgSM2:
		return "sm2"
	case tpm2.TPMAlgECSchnorr:
		return "ecschnorr"
	case tpm2.TPMAlgHMAC:
		return "hmac"
	case tpm2.TPMAlgNull:
		return "null"
	}
	return fmt.Sprintf("0x%04x", uint16(a))
}

// Flush frees a transient object or session; errors are moot at that point,
// and without a resource manager (swtpm, /dev/tpm0) a leaked handle stays
// until reset.
func Flush(t transport.TPM, h tpm2.TPMHandle) {
	_, _ = tpm2.FlushContext{FlushHandle: h}.Execute(t)
}
