package apiserver

import (
	"encoding/hex"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

func TestImportThenGet(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{Mode: attestationv1.Mode_MODE_VERIFY})
	doc := policyDoc(t, true, '1')
	got, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: doc})
	if err != nil {
		t.Fatalf("Import: %v", err)
	}
	if got.GetImage() != img {
		t.Errorf("image = %q", got.GetImage())
	}
	if !proto.Equal(got.GetDocument(), doc) {
		t.Errorf("document changed on import")
	}
	if b, err := hex.DecodeString(got.GetSourceSha256()); err != nil || len(b) != 32 || strings.ToLower(got.GetSourceSha256()) != got.GetSourceSha256() {
		t.Errorf("source sha256 = %q, want 64 lower-case hex", got.GetSourceSha256())
	}
	if want := []uint32{0, 7, 13}; !reflect.DeepEqual(got.GetGoldenPcrs(), want) {
		t.Errorf("golden pcrs = %v, want %v", got.GetGoldenPcrs(), want)
	}
	if got.GetImportTime().AsTime() != time.Date(2025, 6, 1, 12, 0, 1, 0, time.UTC) {
		t.Errorf("import time = %v", got.GetImportTime().AsTime())
	}
	if got.GetGoldenUpdateTime() != nil {
		t.Errorf("golden update time set by a plain import: %v", got.GetGoldenUpdateTime())
	}

	// The stored document is a copy: changing the request afterwards does not change it.
	doc.Fields["pcr13"] = structpb.NewStringValue("mutated")

	read, err := s.GetImagePolicy(ctx, &attestationv1.GetImagePolicyRequest{Image: img})
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if !proto.Equal(read, got) {
		t.Errorf("Get = %v\nwant %v", read, got)
	}
	if read.GetDocument().GetFields()["pcr13"].GetStructValue() == nil {
		t.Errorf("stored document aliased the request")
	}

	// The same document gives the same hash; a different one a different hash.
	again, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, true, '1')})
	if err != nil {
		t.Fatal(err)
	}
	if again.GetSourceSha256() != got.GetSourceSha256() {
		t.Errorf("same document, different hash: %s vs %s", again.GetSourceSha256(), got.GetSourceSha256())
	}
	other, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, true, '2')})
	if err != nil {
		t.Fatal(err)
	}
	if other.GetSourceSha256() == got.GetSourceSha256() {
		t.Errorf("different documents, same hash")
	}
}

func TestImportInvalid(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{})
	for _, ref := range []string{"", "flatcar", "_1", "flatcar_", "../x_1", "a/b_1", "flat car_1", "-x_1"} {
		_, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: ref, Document: policyDoc(t, false, 0)})
		wantCode(t, err, apierr.InvalidRequest)
		var e *apierr.Error
		if !errors.As(err, &e) || e.Metadata["field"] != "image" {
			t.Errorf("ref %q: field = %v", ref, e)
		}
		_, err = s.GetImagePolicy(ctx, &attestationv1.GetImagePolicyRequest{Image: ref})
		wantCode(t, err, apierr.InvalidRequest)
	}

	bad := policyDoc(t, false, 0)
	delete(bad.Fields["pcr11"].GetStructValue().Fields, "enter-initrd")
	_, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: bad})
	wantCode(t, err, apierr.InvalidRequest)
	_, err = s.GetImagePolicy(ctx, &attestationv1.GetImagePolicyRequest{Image: img})
	wantCode(t, err, apierr.NotFound)

	_, err = s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img})
	wantCode(t, err, apierr.InvalidRequest)

	// A document for another image is refused.
	_, err = s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: "flatcar_9999.0.0", Document: policyDoc(t, false, 0)})
	wantCode(t, err, apierr.InvalidRequest)
	_, err = s.GetImagePolicy(ctx, &attestationv1.GetImagePolicyRequest{Image: "flatcar_9999.0.0"})
	wantCode(t, err, apierr.NotFound)

	// An invalid re-import leaves the previous policy in place.
	first, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, true, '1')})
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: bad})
	wantCode(t, err, apierr.InvalidRequest)
	cur, err := s.GetImagePolicy(ctx, &attestationv1.GetImagePolicyRequest{Image: img})
	if err != nil || !proto.Equal(cur, first) {
		t.Errorf("policy after a refused re-import = %v, %v", cur, err)
	}
}

func TestImageRefWithUnderscoreInID(t *testing.T) {
	// The catalog splits <id>_<version> at the last '_' (contract §9), so an
	// id may itself contain '_'.
	s, _, _ := newServer(t, tempDB(t), Options{})
	doc, _ := structpb.NewStruct(map[string]any{"image_id": "my_os", "image_version": "1.0", "golden": map[string]any{"sha256": map[string]any{"0": hex32('a')}}})
	if _, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: "my_os_1.0", Document: doc}); err != nil {
		t.Fatalf("Import my_os_1.0: %v", err)
	}
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000abcd", Image: "my_os_1.0"}); err != nil {
		t.Fatalf("BeginBoot my_os_1.0: %v", err)
	}
}

func TestGetMissing(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{})
	_, err := s.GetImagePolicy(ctx, &attestationv1.GetImagePolicyRequest{Image: img})
	wantCode(t, err, apierr.NotFound)
	_, err = s.ClearGolden(ctx, &attestationv1.ClearGoldenRequest{Image: img})
	wantCode(t, err, apierr.NotFound)
	if ps, err := s.ListImagePolicies(ctx, &attestationv1.ListImagePoliciesRequest{}); err != nil || len(ps.GetPolicies()) != 0 {
		t.Errorf("list of empty store = %v %v", ps, err)
	}
}

func TestClearGoldenAndReimport(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{})
	if _, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, true, '1')}); err != nil {
		t.Fatal(err)
	}
	cleared, err := s.ClearGolden(ctx, &attestationv1.ClearGoldenRequest{Image: img})
	if err != nil {
		t.Fatalf("ClearGolden: %v", err)
	}
	check := func(p *attestationv1.ImagePolicy, what string) {
		t.Helper()
		f := p.GetDocument().GetFields()
		if _, ok := f["golden"]; ok {
			t.Errorf("%s: golden still present", what)
		}
		if _, ok := f["golden_firmware"]; ok {
			t.Errorf("%s: golden_firmware still present", what)
		}
		if _, ok := f["pcr11"]; !ok {
			t.Errorf("%s: pcr11 lost", what)
		}
		if len(p.GetGoldenPcrs()) != 0 {
			t.Errorf("%s: golden pcrs = %v", what, p.GetGoldenPcrs())
		}
		if p.GetGoldenUpdateTime() == nil {
			t.Errorf("%s: golden update time not set", what)
		}
	}
	check(cleared, "ClearGolden result")
	if want := time.Date(2025, 6, 1, 12, 0, 2, 0, time.UTC); cleared.GetGoldenUpdateTime().AsTime() != want {
		t.Errorf("golden update time = %v, want %v", cleared.GetGoldenUpdateTime().AsTime(), want)
	}
	stored, err := s.GetImagePolicy(ctx, &attestationv1.GetImagePolicyRequest{Image: img})
	if err != nil {
		t.Fatal(err)
	}
	check(stored, "stored after clear")
	if !proto.Equal(stored, cleared) {
		t.Errorf("stored %v != returned %v", stored, cleared)
	}

	// A re-import without golden keeps the cleared state and its time.
	re, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, false, 0)})
	if err != nil {
		t.Fatal(err)
	}
	check(re, "re-import without golden")
	if !proto.Equal(re.GetGoldenUpdateTime(), cleared.GetGoldenUpdateTime()) {
		t.Errorf("golden update time changed: %v -> %v", cleared.GetGoldenUpdateTime(), re.GetGoldenUpdateTime())
	}
	if re.GetImportTime().AsTime().Before(cleared.GetGoldenUpdateTime().AsTime()) {
		t.Errorf("import time not updated")
	}

	// A re-import with its own golden uses the new golden.
	withOwn, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, true, '9')})
	if err != nil {
		t.Fatal(err)
	}
	if got := withOwn.GetDocument().GetFields()["golden"].GetStructValue().GetFields()["sha256"].GetStructValue().GetFields()["7"].GetStringValue(); got != hex32('9') {
		t.Errorf("golden[7] = %q, want the new value", got)
	}
	if want := []uint32{0, 7, 13}; !reflect.DeepEqual(withOwn.GetGoldenPcrs(), want) {
		t.Errorf("golden pcrs = %v", withOwn.GetGoldenPcrs())
	}
	if withOwn.GetGoldenUpdateTime() != nil {
		t.Errorf("golden update time kept although the file brought its own golden: %v", withOwn.GetGoldenUpdateTime())
	}
	if _, ok := withOwn.GetDocument().GetFields()["golden_firmware"]; !ok {
		t.Errorf("golden_firmware of the new document lost")
	}
}

// recordGolden simulates what RecordGolden stores: golden values in the
// document and the time they were recorded.
func recordGolden(t *testing.T, st *policystore.Store, c byte) {
	t.Helper()
	_, err := st.UpdatePolicy(img, func(old *attestationv1.ImagePolicy) (*attestationv1.ImagePolicy, error) {
		g := policyDoc(t, true, c)
		old.Document.Fields["golden"] = g.Fields["golden"]
		old.Document.Fields["golden_firmware"] = g.Fields["golden_firmware"]
		old.GoldenPcrs = []uint32{0, 7, 13}
		old.GoldenFromVm = "0000abcd"
		old.GoldenUpdatedBy = "ops@example.com"
		old.GoldenUpdateTime = timestamppb.New(time.Date(2025, 5, 5, 0, 0, 0, 0, time.UTC))
		return old, nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestRecordedGoldenSurvivesReimport(t *testing.T) {
	s, st, _ := newServer(t, tempDB(t), Options{})
	if _, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, false, 0)}); err != nil {
		t.Fatal(err)
	}
	recordGolden(t, st, '5')

	re, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, false, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if got := re.GetDocument().GetFields()["golden"].GetStructValue().GetFields()["sha256"].GetStructValue().GetFields()["13"].GetStringValue(); got != hex32('5') {
		t.Errorf("recorded golden[13] lost on re-import: %q", got)
	}
	if _, ok := re.GetDocument().GetFields()["golden_firmware"]; !ok {
		t.Errorf("recorded golden_firmware lost on re-import")
	}
	if !reflect.DeepEqual(re.GetGoldenPcrs(), []uint32{0, 7, 13}) {
		t.Errorf("golden pcrs = %v", re.GetGoldenPcrs())
	}
	if re.GetGoldenFromVm() != "0000abcd" || re.GetGoldenUpdatedBy() != "ops@example.com" || re.GetGoldenUpdateTime() == nil {
		t.Errorf("golden provenance lost: %q %q %v", re.GetGoldenFromVm(), re.GetGoldenUpdatedBy(), re.GetGoldenUpdateTime())
	}

	// Even an empty document (a valid policy.json of "{}") keeps them.
	empty, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: &structpb.Struct{}})
	if err != nil {
		t.Fatalf("import of {} after recorded golden: %v", err)
	}
	if !reflect.DeepEqual(empty.GetGoldenPcrs(), []uint32{0, 7, 13}) {
		t.Errorf("golden pcrs after {} = %v", empty.GetGoldenPcrs())
	}
}

func TestListImagePoliciesSorted(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{})
	for _, ref := range []string{"zeta_1", "alpha_2", "alpha_10", "Mid_1"} {
		doc := policyDoc(t, false, 0)
		delete(doc.Fields, "image_id")
		if _, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: ref, Document: doc}); err != nil {
			t.Fatalf("import %s: %v", ref, err)
		}
	}
	resp, err := s.ListImagePolicies(ctx, &attestationv1.ListImagePoliciesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, p := range resp.GetPolicies() {
		got = append(got, p.GetImage())
	}
	if want := []string{"Mid_1", "alpha_10", "alpha_2", "zeta_1"}; !reflect.DeepEqual(got, want) {
		t.Errorf("order = %v, want %v", got, want)
	}
	status, err := s.GetAttestationStatus(ctx, &attestationv1.GetAttestationStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if status.GetPolicyCount() != 4 {
		t.Errorf("policy count = %d, want 4", status.GetPolicyCount())
	}
}
