package tpmfork

import (
	"bytes"
	"context"
	"crypto/sha256"
	"os/exec"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"github.com/google/go-tpm/tpm2"
)

func TestPrepareReplaysAndMakesFreshKeys(t *testing.T) {
	_, err := exec.LookPath(swtpm.DefaultBinary)
	need(t, swtpm.DefaultBinary, err == nil)
	ca, err := swtpm.LoadCA(t.TempDir(), "test CA")
	if err != nil {
		t.Fatal(err)
	}
	d1, d2 := sha256.Sum256([]byte("one")), sha256.Sum256([]byte("two"))
	replay := []Extend{{PCR: 4, Bank: tpm2.TPMAlgSHA256, Digest: d1[:]}, {PCR: 4, Bank: tpm2.TPMAlgSHA256, Digest: d2[:]}}
	t0 := time.Now()
	a, err := Prepare(context.Background(), swtpm.Config{}, ca, "vm-a", replay, Options{Platform: PlatformDisabled})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Prepare: %v; permanent %d, volatile %d, savestate %d bytes", time.Since(t0), len(a.Permanent), len(a.Volatile), len(a.SaveState))
	want := foldSHA256(replay, 4)
	if !bytes.Equal(a.PCRs[4], want) {
		t.Errorf("pcr 4 = %x, want %x", a.PCRs[4], want)
	}
	if a.Identity.EKCertificate == nil || ca.Verify(a.Identity.EKCertificate, mustPub(t, a.Identity.EK.Parsed)) != nil {
		t.Error("no valid EK certificate")
	}
	b, err := Prepare(context.Background(), swtpm.Config{}, ca, "vm-b", replay, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(a.Identity.EK.Public, b.Identity.EK.Public) || bytes.Equal(a.Identity.AK.Public, b.Identity.AK.Public) {
		t.Error("two preparations share an EK or AK")
	}
}

func mustPub(t *testing.T, p tpm2.TPMTPublic) any {
	t.Helper()
	k, err := tpm2.Pub(p)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// foldSHA256 is what the replay leaves in a sha256 PCR.
func foldSHA256(replay []Extend, pcr uint32) []byte {
	v := make([]byte, 32)
	for _, e := range replay {
		if e.PCR == pcr && e.Bank == tpm2.TPMAlgSHA256 {
			s := sha256.Sum256(append(v, e.Digest...))
			v = s[:]
		}
	}
	return v
}
