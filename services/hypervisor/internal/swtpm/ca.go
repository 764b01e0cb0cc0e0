package swtpm

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"os"
	"path/filepath"
	"time"

	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// CA is the host's vTPM certificate authority: it signs the EK certificate
// of every vTPM the host provisions, as a TPM vendor signs a chip's, so a
// relying party holding the CA's certificate can check that an EK belongs
// to a vTPM of this host.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

// CA file names in its directory.
const (
	caKeyName  = "ca.key"
	caCertName = "ca.pem"
)

// oidEKCertificate is tcg-kp-EKCertificate (TCG EK Credential Profile).
var oidEKCertificate = asn1.ObjectIdentifier{2, 23, 133, 8, 1}

// LoadCA loads the CA in dir, creating it (an ECDSA P-256 key, mode 0600,
// and a self-signed certificate valid for 20 years) on first use.
func LoadCA(dir, commonName string) (*CA, error) {
	keyPath, certPath := filepath.Join(dir, caKeyName), filepath.Join(dir, caCertName)
	keyPEM, kerr := os.ReadFile(keyPath)
	certPEM, cerr := os.ReadFile(certPath)
	if errors.Is(kerr, fs.ErrNotExist) && errors.Is(cerr, fs.ErrNotExist) {
		return createCA(dir, commonName)
	}
	if kerr != nil || cerr != nil {
		return nil, fmt.Errorf("vTPM CA in %s: %v", dir, errors.Join(kerr, cerr))
	}
	kb, _ := pem.Decode(keyPEM)
	cb, _ := pem.Decode(certPEM)
	if kb == nil || cb == nil {
		return nil, fmt.Errorf("vTPM CA in %s: not PEM", dir)
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("vTPM CA key: %w", err)
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("vTPM CA certificate: %w", err)
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("vTPM CA in %s: the key does not match the certificate", dir)
	}
	return &CA{cert: cert, key: key, pem: certPEM}, nil
}

func createCA(dir, commonName string) (*CA, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{Organization: []string{"vm-manager"}, CommonName: commonName},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(20, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	// The key first: a certificate without its key is refused at the next
	// start, a key without its certificate is written again.
	if err := writeFileSync(filepath.Join(dir, caKeyName), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		return nil, err
	}
	if err := writeFileSync(filepath.Join(dir, caCertName), certPEM, 0o644); err != nil {
		return nil, err
	}
	return &CA{cert: cert, key: key, pem: certPEM}, nil
}

// CertificatePEM is the CA's certificate.
func (c *CA) CertificatePEM() []byte { return bytes.Clone(c.pem) }

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}

// issue signs an EK certificate for ek.
func (c *CA) issue(ek crypto.PublicKey, vmID string) ([]byte, error) {
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{Organization: []string{"vm-manager"}, CommonName: "vTPM EK of vm " + vmID},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              c.cert.NotAfter,
		KeyUsage:              x509.KeyUsageKeyEncipherment,
		UnknownExtKeyUsage:    []asn1.ObjectIdentifier{oidEKCertificate},
		BasicConstraintsValid: true,
	}
	return x509.CreateCertificate(rand.Reader, tmpl, c.cert, ek, c.key)
}

// Verify checks that cert is an EK certificate of this CA for ek.
func (c *CA) Verify(der []byte, ek crypto.PublicKey) error {
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return err
	}
	if err := cert.CheckSignatureFrom(c.cert); err != nil {
		return err
	}
	pub, ok := cert.PublicKey.(*rsa.PublicKey)
	if !ok || !pub.Equal(ek) {
		return errors.New("the certificate is for another key")
	}
	return nil
}

// ekCertAttributes are swtpm_setup's for the EK certificate index: written
// once with platform authorization, then locked (WRITEDEFINE); readable by
// anyone. A guest cannot rewrite it, only the host's provisioning can
// undefine and write it again.
var ekCertAttributes = tpm2.TPMANV{
	PPWrite:        true,
	WriteDefine:    true,
	PPRead:         true,
	OwnerRead:      true,
	AuthRead:       true,
	NoDA:           true,
	PlatformCreate: true,
	NT:             tpm2.TPMNTOrdinary,
}

// nvChunk stays below every TPM's TPM_PT_NV_BUFFER_MAX (libtpms: 1024).
const nvChunk = 768

var platformAuth = tpm2.AuthHandle{Handle: tpm2.TPMRHPlatform, Auth: tpm2.PasswordAuth(nil)}

// ensureEKCert keeps a valid certificate at vtpm.EKCertIndex, or writes a
// new one. created says it wrote.
func (c *CA) ensureEKCert(t transport.TPM, ek *vtpm.Key, vmID string) ([]byte, bool, error) {
	pub, err := tpm2.Pub(ek.Parsed)
	if err != nil {
		return nil, false, err
	}
	old, err := readNV(t, vtpm.EKCertIndex)
	switch {
	case err == nil && c.Verify(old, pub) == nil:
		return old, false, nil
	case err == nil || !vtpm.IsEmptyHandle(err):
		// Another certificate, or an index a guest redefined so that it
		// cannot be read: the host's provisioning writes its own again.
		if _, err := (tpm2.NVUndefineSpace{AuthHandle: platformAuth, NVIndex: tpm2.NamedHandle{Handle: vtpm.EKCertIndex}}).Execute(t); err != nil {
			return nil, false, fmt.Errorf("undefine the index of a stale certificate: %w", err)
		}
	}
	der, err := c.issue(pub, vmID)
	if err != nil {
		return nil, false, err
	}
	_, err = tpm2.NVDefineSpace{
		AuthHandle: platformAuth,
		PublicInfo: tpm2.New2B(tpm2.TPMSNVPublic{
			NVIndex: vtpm.EKCertIndex, NameAlg: tpm2.TPMAlgSHA256, Attributes: ekCertAttributes, DataSize: uint16(len(der)),
		}),
	}.Execute(t)
	if err != nil {
		return nil, false, fmt.Errorf("define NV index %#x: %w", uint32(vtpm.EKCertIndex), err)
	}
	for off := 0; off < len(der); off += nvChunk {
		end := min(off+nvChunk, len(der))
		_, err := tpm2.NVWrite{
			AuthHandle: platformAuth,
			NVIndex:    tpm2.NamedHandle{Handle: vtpm.EKCertIndex},
			Data:       tpm2.TPM2BMaxNVBuffer{Buffer: der[off:end]},
			Offset:     uint16(off),
		}.Execute(t)
		if err != nil {
			return nil, false, fmt.Errorf("write NV index %#x: %w", uint32(vtpm.EKCertIndex), err)
		}
	}
	return der, true, nil
}

// readNV reads a whole NV index with its own (empty) authorization.
func readNV(t transport.TPM, idx tpm2.TPMHandle) ([]byte, error) {
	rsp, err := tpm2.NVReadPublic{NVIndex: idx}.Execute(t)
	if err != nil {
		return nil, err
	}
	p, err := rsp.NVPublic.Contents()
	if err != nil {
		return nil, err
	}
	h := tpm2.AuthHandle{Handle: idx, Name: rsp.NVName, Auth: tpm2.PasswordAuth(nil)}
	out := make([]byte, 0, p.DataSize)
	for off := 0; off < int(p.DataSize); off += nvChunk {
		n := min(nvChunk, int(p.DataSize)-off)
		r, err := tpm2.NVRead{AuthHandle: h, NVIndex: tpm2.NamedHandle{Handle: idx, Name: rsp.NVName}, Size: uint16(n), Offset: uint16(off)}.Execute(t)
		if err != nil {
			return nil, err
		}
		out = append(out, r.Data.Buffer...)
	}
	return out, nil
}

// writeFileSync writes a file through a synced temporary file and a rename.
func writeFileSync(path string, b []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
