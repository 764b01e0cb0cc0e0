package apiserver

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/protobuf/types/known/structpb"
)

// ociDoc is the policy.json the hypervisor writes when it imports an OCI
// image: golden values of a direct-kernel boot (zeros here) and the oci
// object.
func ociDoc(t *testing.T, oci map[string]any) *structpb.Struct {
	t.Helper()
	g := map[string]any{}
	for _, i := range []string{"2", "3", "4", "6", "7", "9"} {
		g[i] = strings.Repeat("0", 64)
	}
	d, err := structpb.NewStruct(map[string]any{"image_id": "flatcar", "image_version": "4230.2.0", "golden": map[string]any{"sha256": g}, "oci": oci})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// The catalog's sync stores the oci object; a quote whose PCR 15 holds its
// root verifies, and the VM's attestation, as GET
// /api/v1/vms/{id}/attestation returns it from the store, names the image.
// A root of other content is refused, naming both root hashes.
func TestOCIImageAttestation(t *testing.T) {
	root := hex.EncodeToString(measure.Digest([]byte("erofs root")))
	oci := map[string]any{
		"reference":       "localhost:5000/python:3.12",
		"manifest_digest": "sha256:" + hex32('a'),
		"config_digest":   "sha256:" + hex32('b'),
		"root_hash":       root,
	}
	s, _, _ := newServer(t, tempDB(t), Options{Mode: attestationv1.Mode_MODE_VERIFY})
	if _, err := s.SyncImagePolicy(ctx, &attestationv1.SyncImagePolicyRequest{Image: img, Document: ociDoc(t, oci)}); err != nil {
		t.Fatal(err)
	}
	k := softAK(t)
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true, AkPublic: k.Public, DirectKernel: true}); err != nil {
		t.Fatal(err)
	}
	quote := func(root string) *attestationv1.VerifyQuoteResponse {
		pcrs := zeros(attestationv1.Stage_STAGE_INITRD, 9, 12)
		pcrs[15] = measure.PCR15(root)
		var log bytes.Buffer
		if err := measure.WriteRecord(&log, measure.WordRecord(15, measure.VerityRootWord(root), measure.EventTypeVerityRoot, "", 0)); err != nil {
			t.Fatal(err)
		}
		n := nonceFor(t, s, vmA)
		att, sig, err := k.Quote(n, pcrs)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := s.VerifyQuote(ctx, &attestationv1.VerifyQuoteRequest{VmId: vmA, Stage: attestationv1.Stage_STAGE_INITRD, Nonce: n, AkPub: k.Public,
			Quote: att, Signature: sig, Pcrs: pcrs, UserspaceLog: log.Bytes()})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}

	other := hex.EncodeToString(measure.Digest([]byte("another root")))
	expectVerdict(t, quote(other), false, fmt.Sprintf("verity root mismatch: pcr 15 expected %x, got %x; the guest measured root hash %s for oci image localhost:5000/python:3.12@sha256:%s, whose root hash is %s",
		measure.PCR15(root), measure.PCR15(other), other, hex32('a'), root))

	expectVerdict(t, quote(root), true, fmt.Sprintf(", oci localhost:5000/python:3.12@sha256:%s root %s", hex32('a'), root))
	got, err := s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: vmA})
	if err != nil {
		t.Fatal(err)
	}
	if o := got.GetInitrd().GetOci(); o.GetReference() != oci["reference"] || o.GetManifestDigest() != oci["manifest_digest"] || o.GetConfigDigest() != oci["config_digest"] || o.GetRootHash() != root {
		t.Errorf("stored verdict names oci image %v", o)
	}

	// A malformed oci object is refused on sync, naming its field.
	oci["root_hash"] = root[:62]
	_, err = s.SyncImagePolicy(ctx, &attestationv1.SyncImagePolicyRequest{Image: img, Document: ociDoc(t, oci)})
	wantCode(t, err, apierr.InvalidRequest)
	var e *apierr.Error
	if !errors.As(err, &e) || e.Metadata["field"] != "document.oci.root_hash" {
		t.Errorf("field = %v", e)
	}
}
