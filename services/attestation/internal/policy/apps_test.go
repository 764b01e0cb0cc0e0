package policy

import (
	"encoding/hex"
	"strings"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/types/known/structpb"
)

// pcr4 is a UKI boot's PCR 4 as OVMF logs it: the boot option's action, the
// separator, then each application started (Authenticode hashes).
func pcr4(apps ...[]byte) []verify.Event {
	evs := []verify.Event{
		{PCR: 4, Type: "EV_EFI_ACTION", Description: "Calling EFI Application from Boot Option", Digest: measure.Digest([]byte("Calling EFI Application from Boot Option"))},
		{PCR: 4, Type: "EV_SEPARATOR", Digest: measure.Digest([]byte{0, 0, 0, 0})},
	}
	for i, a := range apps {
		evs = append(evs, verify.Event{PCR: 4, Type: typeApplication, Description: []string{`\EFI\BOOT\BOOTX64.EFI`, "kernel", "third"}[i], Digest: a})
	}
	return evs
}

func TestPCR4NamesForeignApplications(t *testing.T) {
	uki, linux, loader := measure.Digest([]byte("uki")), measure.Digest([]byte("linux")), measure.Digest([]byte("systemd-boot"))
	good := pcr4(uki, linux)
	doc := func() *structpb.Struct {
		g := goldenAll()
		g["4"] = hex.EncodeToString(fold(good, 4))
		d, err := structpb.NewStruct(map[string]any{
			"golden": map[string]any{"sha256": g},
			"uki":    map[string]any{"authenticode": map[string]any{"uki": hex.EncodeToString(uki), "linux": hex.EncodeToString(linux)}},
		})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}()
	initrd := attestationv1.Stage_STAGE_INITRD
	pcrs := func(evs []verify.Event) map[uint32][]byte {
		p := quoted(initrd)
		p[4] = fold(evs, 4)
		return p
	}

	if out := Evaluate(doc, initrd, "", false, "", pcrs(good), good, false); out.Reason != "" {
		t.Fatalf("the image's own boot chain: %s", out.Reason)
	}
	// Another loader first, then the genuine UKI and kernel.
	chain := pcr4(loader, uki, linux)
	out := Evaluate(doc, initrd, "", false, "", pcrs(chain), chain, false)
	if !strings.Contains(out.Reason, `golden mismatch: pcr 4 expected`) ||
		!strings.Contains(out.Reason, `first differing event: EFI application \EFI\BOOT\BOOTX64.EFI (authenticode `+short(loader)+`) is not the image's (linux `+short(linux)+`, uki `+short(uki)+`)`) {
		t.Errorf("reason %q", out.Reason)
	}
	if len(out.MismatchedEvents) != 1 || out.MismatchedEvents[0].GetDigest() != hex.EncodeToString(loader) {
		t.Errorf("mismatched events %v, want the loader alone", out.MismatchedEvents)
	}
	for _, i := range out.Mismatched {
		if i == 4 {
			t.Error("pcr 4 left for the stored golden boot to name")
		}
	}

	// A log that does not replay to the quoted PCR 4 names nothing.
	forged := pcr4(uki, linux)
	out = Evaluate(doc, initrd, "", false, "", pcrs(chain), forged, false)
	if !strings.Contains(out.Reason, "golden mismatch: pcr 4") || strings.Contains(out.Reason, "first differing event") || len(out.MismatchedEvents) != 0 {
		t.Errorf("unreplayed log: %q %v", out.Reason, out.MismatchedEvents)
	}
	// Without uki.authenticode, PCR 4 is named from the stored golden boot.
	plain, _ := structpb.NewStruct(map[string]any{"golden": doc.GetFields()["golden"].AsInterface()})
	out = Evaluate(plain, initrd, "", false, "", pcrs(chain), chain, false)
	if strings.Contains(out.Reason, "first differing event") || len(out.Mismatched) != 1 || out.Mismatched[0] != 4 {
		t.Errorf("without uki.authenticode: %q %v", out.Reason, out.Mismatched)
	}
}
