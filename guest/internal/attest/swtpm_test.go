package attest

import (
	"crypto/sha256"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// withTPM runs f on a connection that is closed afterwards: swtpm serves one client
// at a time, so the code under test cannot connect while a test holds one.
func withTPM(t *testing.T, sock string, f func(transport.TPM)) {
	t.Helper()
	tpm, err := OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close()
	f(tpm)
}

// extend gives the PCRs distinct non-zero values, so a wrong order or index shows.
func extend(t *testing.T, tpm transport.TPM, pcrs ...uint) {
	t.Helper()
	for _, i := range pcrs {
		d := sha256.Sum256([]byte{byte(i), 'x'})
		_, err := tpm2.PCRExtend{
			PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(i), Auth: tpm2.PasswordAuth(nil)},
			Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: d[:]}}},
		}.Execute(tpm)
		if err != nil {
			t.Fatalf("extending PCR %d: %v", i, err)
		}
	}
}

// transientHandles lists loaded transient objects: without a resource manager a
// leaked one would stay until the TPM resets.
func transientHandles(t *testing.T, tpm transport.TPM) []tpm2.TPMHandle {
	t.Helper()
	rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapHandles, Property: 0x80000000, PropertyCount: 16}.Execute(tpm)
	if err != nil {
		t.Fatal(err)
	}
	h, err := rsp.CapabilityData.Data.Handles()
	if err != nil {
		t.Fatal(err)
	}
	return h.Handle
}
