package attest

import (
	"bytes"
	"slices"
	"testing"

	"github.com/google/go-tpm-tools/client"
	legacy "github.com/google/go-tpm/legacy/tpm2"
	"github.com/google/go-tpm/tpm2"
)

// The templates are go-tpm-tools' standard ones; only the AK adds noDA (contract
// §5.3), so a guest that counts dictionary-attack failures cannot lock the AK out.
func TestTemplatesMatchGoTPMTools(t *testing.T) {
	encode := func(p legacy.Public) []byte {
		t.Helper()
		b, err := p.Encode()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}

	ak := client.AKTemplateECC()
	if ak.Attributes&legacy.FlagNoDA != 0 {
		t.Fatal("go-tpm-tools' AK template has noDA now: drop the difference")
	}
	ak.Attributes |= legacy.FlagNoDA
	theirs, err := tpm2.Unmarshal[tpm2.TPMTPublic](encode(ak))
	if err != nil {
		t.Fatal(err)
	}
	mine := AKTemplate()
	if !matchesTemplate(*theirs, mine) { // all but unique, which TPM2_Create fills
		t.Errorf("AK template differs from client.AKTemplateECC + noDA:\n%x\n%x", tpm2.Marshal(*theirs), tpm2.Marshal(mine))
	}
	a := mine.ObjectAttributes
	if !a.FixedTPM || !a.FixedParent || !a.SensitiveDataOrigin || !a.UserWithAuth || !a.NoDA || !a.Restricted || !a.SignEncrypt ||
		a.Decrypt || a.AdminWithPolicy || a.STClear || a.EncryptedDuplication {
		t.Errorf("AK attributes %s", attrString(a))
	}

	for name, c := range map[string]struct {
		theirs legacy.Public
		mine   tpm2.TPMTPublic
	}{
		"RSA EK (client.EndorsementKeyRSA)":  {client.DefaultEKTemplateRSA(), tpm2.RSAEKTemplate},
		"ECC SRK (client.StorageRootKeyECC)": {client.SRKTemplateECC(), tpm2.ECCSRKTemplate},
	} {
		if !bytes.Equal(encode(c.theirs), tpm2.Marshal(c.mine)) {
			t.Errorf("%s template differs from go-tpm-tools'", name)
		}
	}
}

func TestStagePCRs(t *testing.T) {
	for stage, want := range map[string][]uint{
		StageInitrd: {0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 15},
		StageReady:  {0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13, 15},
	} {
		pcrs, err := StagePCRs(stage)
		if err != nil || !slices.Equal(pcrs, want) {
			t.Errorf("%s: %v %v", stage, pcrs, err)
		}
	}
	if _, err := StagePCRs("boot"); err == nil {
		t.Error("unknown stage accepted")
	}
}

// Quotes carry the log vm-agent writes its extends to, at the contract's path.
func TestUserspaceLogPath(t *testing.T) {
	if DefaultUserspaceLogPath != "/run/log/systemd/tpm2-measure.log" {
		t.Errorf("userspace log %q", DefaultUserspaceLogPath)
	}
}
