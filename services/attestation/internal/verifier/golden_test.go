package verifier

import (
	"errors"
	"fmt"
	"reflect"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
)

func TestRecordGoldenNeedsAVerifiedReadyQuote(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	_, err := r.v.RecordGolden(img, vmA, "ada")
	if apierr.CodeOf(err) != apierr.Conflict {
		t.Errorf("without a ready quote: %v, want conflict", err)
	}
	bad := zeros(ready)
	bad[2][0] = 1
	expect(t, r.verify(r.quote(r.ak, ready, r.nonce(), bad)), false, "golden mismatch")
	if _, err := r.v.RecordGolden(img, vmA, "ada"); apierr.CodeOf(err) != apierr.Conflict {
		t.Errorf("after a rejected ready quote: %v, want conflict", err)
	}
	expect(t, r.verify(r.quote(r.ak, ready, r.nonce(), zeros(ready))), true, "verified")
	_, err = r.v.RecordGolden("flatcar_9999.0.0", vmA, "ada")
	var e *apierr.Error
	if !errors.As(err, &e) || e.Code != apierr.InvalidRequest || e.Metadata["field"] != "from_vm" {
		t.Errorf("another image's golden values from vm %s: %v", vmA, err)
	}
	if _, err := r.v.RecordGolden(img, "0e0e0e0e", "ada"); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("unknown vm: %v", err)
	}
	if got := r.pols.policies[img].GetGoldenFromVm(); got != "" {
		t.Errorf("a refused recording changed the policy: golden from %q", got)
	}
}

// The ready quote's PCRs become the golden values, with the firmware they
// were measured on and who asked; the rest of the policy stays, and the
// quote's events are kept to name a later mismatch's.
func TestRecordGolden(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	pcrs := zeros(ready)
	pcrs[9] = make([]byte, 32) // quoted, with no golden value yet
	expect(t, r.verify(r.quote(r.ak, ready, r.nonce(), pcrs)), true, "verified")
	// What BeginBoot and a ready quote with logs would have stored.
	events := []verify.Event{{PCR: 4, Type: "EV_EFI_BOOT_SERVICES_APPLICATION", Description: "shim", Digest: []byte{1}}}
	rec := r.vms.recs[vmA]
	rec.vm.Firmware = &policystore.Firmware{SHA256: "ab", Package: "ovmf", Version: "2"}
	rec.vm.DirectKernel = true
	rec.vm.ReadyEvents = events
	r.vms.recs[vmA] = rec

	p, err := r.v.RecordGolden(img, vmA, "ada@example.com")
	if err != nil {
		t.Fatal(err)
	}
	f := p.GetDocument().GetFields()
	g := f["golden"].GetStructValue().GetFields()["sha256"].GetStructValue().AsMap()
	if len(g) != 7 || g["9"] != zero || g["13"] != zero || g["0"] != nil {
		t.Errorf("golden %v, want 2,3,4,6,7,9,13 (0 depends on the vm's memory and cpus)", g)
	}
	if fmt.Sprint(p.GetGoldenPcrs()) != "[2 3 4 6 7 9 13]" {
		t.Errorf("golden pcrs %v", p.GetGoldenPcrs())
	}
	if fw := f["golden_firmware"].GetStructValue().AsMap(); !reflect.DeepEqual(fw, map[string]any{"sha256": "ab", "package": "ovmf", "version": "2"}) {
		t.Errorf("golden firmware %v", fw)
	}
	if f["pcr11"] == nil {
		t.Error("pcr11 lost")
	}
	if p.GetGoldenFromVm() != vmA || p.GetGoldenUpdatedBy() != "ada@example.com" || !p.GetGoldenUpdateTime().AsTime().Equal(r.now) {
		t.Errorf("provenance %q %q %v", p.GetGoldenFromVm(), p.GetGoldenUpdatedBy(), p.GetGoldenUpdateTime())
	}
	if !reflect.DeepEqual(r.pols.golden[img], events) {
		t.Errorf("golden events %v, want the ready quote's", r.pols.golden[img])
	}
	// A firmware without a package is recorded by its digest alone.
	rec.vm.Firmware = &policystore.Firmware{SHA256: "cd"}
	r.vms.recs[vmA] = rec
	p, err = r.v.RecordGolden(img, vmA, "ada@example.com")
	if fw := p.GetDocument().GetFields()["golden_firmware"].GetStructValue().AsMap(); err != nil || !reflect.DeepEqual(fw, map[string]any{"sha256": "cd"}) {
		t.Errorf("golden firmware %v %v", fw, err)
	}
	// A vm whose firmware is unknown leaves none: the old one was not what
	// these values were measured on.
	rec.vm.Firmware = nil
	r.vms.recs[vmA] = rec
	p, err = r.v.RecordGolden(img, vmA, "ada@example.com")
	if _, ok := p.GetDocument().GetFields()["golden_firmware"]; err != nil || ok {
		t.Errorf("golden firmware kept from an earlier recording (%v)", err)
	}
}

// An image without a policy (a learn-mode bring-up) gets one from the
// golden values.
func TestRecordGoldenMakesAPolicy(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY, LearnGolden: true})
	delete(r.pols.policies, img)
	expect(t, r.verify(r.quote(r.ak, ready, r.nonce(), zeros(ready))), true, "verified in learn mode")
	p, err := r.v.RecordGolden(img, vmA, "")
	if err != nil {
		t.Fatal(err)
	}
	f := p.GetDocument().GetFields()
	if p.GetImage() != img || f["image_id"].GetStringValue() != "flatcar" || f["image_version"].GetStringValue() != "4230.2.0" || p.GetImportTime() == nil {
		t.Errorf("made %v", p)
	}
	if _, ok := f["golden_firmware"]; ok {
		t.Error("golden firmware recorded for a vm whose firmware is unknown")
	}
	if fmt.Sprint(p.GetGoldenPcrs()) != "[2 3 4 6 7 13]" || r.pols.policies[img] != p {
		t.Errorf("golden pcrs %v (stored: %v)", p.GetGoldenPcrs(), r.pols.policies[img] == p)
	}
}
