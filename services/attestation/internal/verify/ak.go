package verify

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"math/big"
	"strings"

	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/google/go-tpm/tpm2"
)

// CheckAK parses an attestation key as a quote's would be (TPMT_PUBLIC or
// TPM2B_PUBLIC) and returns its normalized TPMT_PUBLIC and fingerprint: how
// a key registered for a VM is stored and compared.
func CheckAK(in []byte) (tpmtPublic []byte, fingerprint string, err error) {
	k, rej := parseAK(in)
	if rej != nil {
		return nil, "", rej
	}
	return bytes.Clone(k.raw), k.fp, nil
}

// AK is a parsed attestation key, to be given back to Check in
// Quote.Key: the VM's registered key need not be parsed per quote.
type AK = akKey

// ParseAK parses an attestation key as Check would (CheckAK's rules).
func ParseAK(in []byte) (*AK, error) {
	k, rej := parseAK(in)
	if rej != nil {
		return nil, rej
	}
	return k, nil
}

// Fingerprint is the hex SHA-256 of the key's TPMT_PUBLIC.
func (k *AK) Fingerprint() string { return k.fp }

// akKey is a parsed attestation key.
type akKey struct {
	raw    []byte // TPMT_PUBLIC
	fp     string // hex sha256 of raw
	scheme tpm2.TPMAlgID
	hash   tpm2.TPMAlgID
	ecc    *ecdsa.PublicKey
	rsa    *rsa.PublicKey
}

// stripTPM2B drops a TPM2B_PUBLIC size prefix. A TPMT_PUBLIC starts with
// its type (0x0001 or 0x0023), which never equals the remaining length of a
// real key, so the two forms cannot be confused.
func stripTPM2B(b []byte) []byte {
	if len(b) >= 2 && int(binary.BigEndian.Uint16(b)) == len(b)-2 {
		return b[2:]
	}
	return b
}

func parseAK(in []byte) (*akKey, *Rejection) {
	b := stripTPM2B(in)
	pub, err := tpm2.Unmarshal[tpm2.TPMTPublic](b)
	if err != nil {
		return nil, reject("ak public area does not parse: %v", err)
	}

	a := pub.ObjectAttributes
	var bad []string
	for _, c := range []struct {
		ok   bool
		name string
	}{
		{a.FixedTPM, "not fixedTPM"},
		{a.FixedParent, "not fixedParent"},
		{a.SensitiveDataOrigin, "not sensitiveDataOrigin"},
		{a.Restricted, "not restricted"},
		{a.SignEncrypt, "not sign"},
		{!a.Decrypt, "can decrypt"},
	} {
		if !c.ok {
			bad = append(bad, c.name)
		}
	}
	if len(bad) > 0 {
		return nil, reject("ak is unsuitable: %s (an ak must be fixedTPM, fixedParent, sensitiveDataOrigin, restricted, sign and not decrypt)", strings.Join(bad, ", "))
	}

	fp := sha256.Sum256(b)
	k := &akKey{raw: bytes.Clone(b), fp: hex.EncodeToString(fp[:])}
	switch pub.Type {
	case tpm2.TPMAlgECC:
		p, err := pub.Parameters.ECCDetail()
		if err != nil {
			return nil, reject("ak ecc parameters do not parse: %v", err)
		}
		if p.CurveID != tpm2.TPMECCNistP256 {
			return nil, reject("ak curve 0x%04x is not nist p-256", uint16(p.CurveID))
		}
		if p.Scheme.Scheme != tpm2.TPMAlgECDSA {
			return nil, reject("ak scheme %s is not ecdsa", algName(p.Scheme.Scheme))
		}
		s, err := p.Scheme.Details.ECDSA()
		if err != nil {
			return nil, reject("ak ecdsa scheme does not parse: %v", err)
		}
		k.scheme, k.hash = tpm2.TPMAlgECDSA, s.HashAlg
		pt, err := pub.Unique.ECC()
		if err != nil {
			return nil, reject("ak ecc point does not parse: %v", err)
		}
		x, y := pt.X.Buffer, pt.Y.Buffer
		if len(x) > 32 || len(y) > 32 {
			return nil, reject("ak ecc point is not on nist p-256")
		}
		enc := make([]byte, 65)
		enc[0] = 4
		copy(enc[33-len(x):33], x)
		copy(enc[65-len(y):], y)
		if k.ecc, err = ecdsa.ParseUncompressedPublicKey(elliptic.P256(), enc); err != nil {
			return nil, reject("ak ecc point is not on nist p-256")
		}
	case tpm2.TPMAlgRSA:
		p, err := pub.Parameters.RSADetail()
		if err != nil {
			return nil, reject("ak rsa parameters do not parse: %v", err)
		}
		n, err := pub.Unique.RSA()
		if err != nil {
			return nil, reject("ak rsa modulus does not parse: %v", err)
		}
		mod := new(big.Int).SetBytes(n.Buffer)
		if p.KeyBits != 2048 || len(n.Buffer) != 256 || mod.BitLen() != 2048 {
			return nil, reject("ak rsa key is %d bits, want 2048", mod.BitLen())
		}
		// The TPM's default exponent is 65537, written as 0.
		if p.Exponent != 0 && p.Exponent != 65537 {
			return nil, reject("ak rsa exponent %d is not 65537", p.Exponent)
		}
		switch p.Scheme.Scheme {
		case tpm2.TPMAlgRSASSA:
			s, err := p.Scheme.Details.RSASSA()
			if err != nil {
				return nil, reject("ak rsassa scheme does not parse: %v", err)
			}
			k.hash = s.HashAlg
		case tpm2.TPMAlgRSAPSS:
			s, err := p.Scheme.Details.RSAPSS()
			if err != nil {
				return nil, reject("ak rsapss scheme does not parse: %v", err)
			}
			k.hash = s.HashAlg
		default:
			return nil, reject("ak scheme %s is not rsassa or rsapss", algName(p.Scheme.Scheme))
		}
		k.scheme = p.Scheme.Scheme
		k.rsa = &rsa.PublicKey{N: mod, E: 65537}
	default:
		return nil, reject("ak type %s is not ecc or rsa", algName(pub.Type))
	}
	if _, ok := sigHash(k.hash); !ok {
		return nil, reject("ak scheme hash %s is not sha256, sha384 or sha512", algName(k.hash))
	}
	// A fingerprint must name one encoding of one key.
	if !bytes.Equal(tpm2.Marshal(*pub), b) {
		return nil, reject("ak public area is not a canonical TPMT_PUBLIC (trailing or truncated bytes)")
	}
	return k, nil
}

func sigHash(a tpm2.TPMAlgID) (crypto.Hash, bool) {
	switch a {
	case tpm2.TPMAlgSHA256:
		return crypto.SHA256, true
	case tpm2.TPMAlgSHA384:
		return crypto.SHA384, true
	case tpm2.TPMAlgSHA512:
		return crypto.SHA512, true
	}
	return 0, false
}

// signature is a parsed TPMT_SIGNATURE that suits its AK.
type signature struct {
	hash crypto.Hash
	r, s *big.Int // ecdsa
	rsa  []byte
}

func parseSignature(b []byte, ak *akKey) (*signature, *Rejection) {
	ts, fast := fastSignature(b)
	var err error
	if !fast {
		if ts, err = tpm2.Unmarshal[tpm2.TPMTSignature](b); err != nil {
			return nil, reject("signature does not parse: %v", err)
		}
	}
	// A restricted key signs only with its own scheme.
	if ts.SigAlg != ak.scheme {
		return nil, reject("signature scheme %s does not match the ak scheme %s", algName(ts.SigAlg), algName(ak.scheme))
	}
	var (
		sig  signature
		hash tpm2.TPMAlgID
	)
	switch ts.SigAlg {
	case tpm2.TPMAlgECDSA:
		e, err := ts.Signature.ECDSA()
		if err != nil {
			return nil, reject("signature does not parse: %v", err)
		}
		hash = e.Hash
		sig.r = new(big.Int).SetBytes(e.SignatureR.Buffer)
		sig.s = new(big.Int).SetBytes(e.SignatureS.Buffer)
	case tpm2.TPMAlgRSASSA, tpm2.TPMAlgRSAPSS:
		var r *tpm2.TPMSSignatureRSA
		if ts.SigAlg == tpm2.TPMAlgRSASSA {
			r, err = ts.Signature.RSASSA()
		} else {
			r, err = ts.Signature.RSAPSS()
		}
		if err != nil {
			return nil, reject("signature does not parse: %v", err)
		}
		hash = r.Hash
		sig.rsa = r.Sig.Buffer
	}
	if hash != ak.hash {
		return nil, reject("signature hash %s does not suit the ak, whose scheme signs with %s", algName(hash), algName(ak.hash))
	}
	sig.hash, _ = sigHash(hash)
	if !fast && !bytes.Equal(tpm2.Marshal(*ts), b) {
		return nil, reject("signature is not a canonical TPMT_SIGNATURE (trailing or truncated bytes)")
	}
	return &sig, nil
}

func (s *signature) verify(ak *akKey, digest []byte) bool {
	switch {
	case ak.ecc != nil:
		return ecdsa.Verify(ak.ecc, digest, s.r, s.s)
	case ak.scheme == tpm2.TPMAlgRSASSA:
		return rsa.VerifyPKCS1v15(ak.rsa, s.hash, digest, s.rsa) == nil
	case ak.scheme == tpm2.TPMAlgRSAPSS:
		// TPMs differ in the salt length they use; any valid one will do.
		return rsa.VerifyPSS(ak.rsa, s.hash, digest, s.rsa, &rsa.PSSOptions{SaltLength: rsa.PSSSaltLengthAuto, Hash: s.hash}) == nil
	}
	return false
}

func algName(a tpm2.TPMAlgID) string { return vtpm.AlgName(a) }

// Public is the key's TPMT_PUBLIC (no size prefix): what gets registered.
func (k *AK) Public() []byte { return bytes.Clone(k.raw) }
