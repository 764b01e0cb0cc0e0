package apiserver

import (
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"google.golang.org/protobuf/proto"
)

// TestGoldenRecordsCaller: RecordGolden and ClearGolden record the caller on
// the policy (golden_updated_by); an anonymous caller records "".
func TestGoldenRecordsCaller(t *testing.T) {
	s, st, _ := newServer(t, tempDB(t), Options{})
	if _, err := s.SyncImagePolicy(ctx, &attestationv1.SyncImagePolicyRequest{Image: img, Document: policyDoc(t, false, 0)}); err != nil {
		t.Fatalf("SyncImagePolicy: %v", err)
	}
	pcrs := map[uint32]string{}
	for _, i := range []uint32{0, 2, 3, 4, 6, 7, 13} {
		pcrs[i] = hex32('a')
	}
	if err := st.PutVM(&policystore.VM{ID: "0000abcd", Image: img}, &attestationv1.Attestation{Boot: 1, Ready: &attestationv1.Quote{Verified: true, Pcrs: pcrs}}); err != nil {
		t.Fatal(err)
	}
	ada := identity.NewContext(ctx, identity.Identity{Subject: "u-1", Email: "ada@example.com"})
	p, err := s.RecordGolden(ada, &attestationv1.RecordGoldenRequest{Image: img, FromVm: "0000abcd"})
	if err != nil {
		t.Fatalf("RecordGolden: %v", err)
	}
	if p.GetGoldenUpdatedBy() != "ada@example.com" || p.GetGoldenFromVm() != "0000abcd" {
		t.Errorf("RecordGolden: updated by %q from %q", p.GetGoldenUpdatedBy(), p.GetGoldenFromVm())
	}
	svc := identity.NewContext(ctx, identity.Identity{Subject: "svc-7"})
	p, err = s.ClearGolden(svc, &attestationv1.ClearGoldenRequest{Image: img})
	if err != nil {
		t.Fatalf("ClearGolden: %v", err)
	}
	if p.GetGoldenUpdatedBy() != "svc-7" {
		t.Errorf("ClearGolden: updated by %q, want the subject", p.GetGoldenUpdatedBy())
	}
	p, err = s.ClearGolden(ctx, &attestationv1.ClearGoldenRequest{Image: img})
	if err != nil {
		t.Fatal(err)
	}
	if p.GetGoldenUpdatedBy() != "" {
		t.Errorf("anonymous ClearGolden: updated by %q", p.GetGoldenUpdatedBy())
	}
}

// TestSyncImagePolicyIsImport: the internal SyncImagePolicy stores what the
// public ImportImagePolicy stores.
func TestSyncImagePolicyIsImport(t *testing.T) {
	a, _, _ := newServer(t, tempDB(t), Options{})
	b, _, _ := newServer(t, tempDB(t), Options{})
	imported, err := a.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, true, '1')})
	if err != nil {
		t.Fatal(err)
	}
	synced, err := b.SyncImagePolicy(ctx, &attestationv1.SyncImagePolicyRequest{Image: img, Document: policyDoc(t, true, '1')})
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(imported, synced) {
		t.Errorf("sync stored %v, import %v", synced, imported)
	}
	if _, err := b.SyncImagePolicy(ctx, &attestationv1.SyncImagePolicyRequest{Image: "no-version", Document: policyDoc(t, true, '1')}); err == nil {
		t.Error("SyncImagePolicy accepted an invalid image ref")
	}
}
