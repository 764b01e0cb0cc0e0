package verifier

import (
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policy"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// RecordGolden copies a VM's verified ready-stage PCRs into its image's
// golden values, with the firmware they were measured on, keeping every
// other field of the policy; the ready quote's events are kept to name what
// a later mismatch differs in. image must be a valid image reference; by is
// who asked (golden_updated_by).
func (v *Verifier) RecordGolden(image, fromVM, by string) (*attestationv1.ImagePolicy, error) {
	vm, att, err := v.vms.GetVM(fromVM)
	if err != nil {
		return nil, err
	}
	if vm.Image != image {
		return nil, apierr.Invalidf("from_vm", "vm %s runs image %s, not %s", vm.ID, vm.Image, image)
	}
	ready := att.GetReady()
	if !ready.GetVerified() {
		return nil, apierr.Errorf(apierr.Conflict, "vm %s has no verified ready-stage quote in its current boot", vm.ID)
	}
	values := map[string]any{}
	for _, idx := range policy.GoldenPCRsFor(attestationv1.Stage_STAGE_READY, vm.DirectKernel) {
		pcr, ok := ready.GetPcrs()[idx]
		if !ok {
			return nil, apierr.Errorf(apierr.Conflict, "the ready quote of vm %s lacks pcr %d", vm.ID, idx)
		}
		values[strconv.Itoa(int(idx))] = pcr
	}
	if pcr, ok := ready.GetPcrs()[9]; ok {
		values["9"] = pcr // vm-agent quotes it on any image: pinned when there
	}
	golden, err := structpb.NewValue(map[string]any{"sha256": values})
	if err != nil {
		return nil, err
	}
	p, err := v.policies.UpdatePolicy(image, func(old *attestationv1.ImagePolicy) (*attestationv1.ImagePolicy, error) {
		if old == nil {
			// An image without a policy (a learn-mode bring-up): the
			// golden values make one.
			cut := strings.LastIndex(image, "_") // versions have no "_"
			id, ver := image[:cut], image[cut+1:]
			old = &attestationv1.ImagePolicy{Image: image, ImportTime: timestamppb.New(v.now()), Document: &structpb.Struct{Fields: map[string]*structpb.Value{
				"image_id": structpb.NewStringValue(id), "image_version": structpb.NewStringValue(ver),
			}}}
		}
		p := proto.Clone(old).(*attestationv1.ImagePolicy)
		if p.Document == nil {
			p.Document = &structpb.Struct{}
		}
		if p.Document.Fields == nil {
			p.Document.Fields = map[string]*structpb.Value{}
		}
		p.Document.Fields["golden"] = golden
		delete(p.Document.Fields, "golden_firmware")
		if fw := vm.Firmware; fw != nil {
			m := map[string]any{"sha256": fw.SHA256}
			if fw.Package != "" {
				m["package"], m["version"] = fw.Package, fw.Version
			}
			fwv, err := structpb.NewValue(m)
			if err != nil {
				return nil, err
			}
			p.Document.Fields["golden_firmware"] = fwv
		}
		p.GoldenPcrs = policy.GoldenPCRs(p.Document)
		p.GoldenFromVm = vm.ID
		p.GoldenUpdatedBy = by
		p.GoldenUpdateTime = timestamppb.New(v.now())
		return p, nil
	})
	if err != nil {
		return nil, err
	}
	if err := v.policies.PutGoldenEvents(image, vm.ReadyEvents); err != nil {
		return nil, err
	}
	v.log.Info("golden values recorded", "image", image, "vm", vm.ID, "pcrs", slices.Sorted(maps.Keys(values)))
	return p, nil
}

// firmwareMismatch refuses a VM that boots another firmware build than the
// one the image's golden values were recorded on (golden_firmware.sha256),
// when both are known.
func firmwareMismatch(doc *structpb.Struct, running *policystore.Firmware) string {
	golden := doc.GetFields()["golden_firmware"].GetStructValue().GetFields()
	want := golden["sha256"].GetStringValue()
	if want == "" || running == nil || running.SHA256 == "" || strings.EqualFold(want, running.SHA256) {
		return ""
	}
	return fmt.Sprintf("firmware mismatch: the golden values were recorded on firmware %s, this vm boots %s",
		firmwareName(golden["package"].GetStringValue(), golden["version"].GetStringValue(), want),
		firmwareName(running.Package, running.Version, running.SHA256))
}

func firmwareName(pkg, ver, sum string) string {
	if pkg == "" {
		return "sha256 " + short(sum)
	}
	return fmt.Sprintf("%s %s (sha256 %s)", pkg, ver, short(sum))
}

func hexPCRs(in map[uint32][]byte) map[uint32]string {
	out := make(map[uint32]string, len(in))
	for k, v := range in {
		out[k] = hex.EncodeToString(v)
	}
	return out
}

// short is a fingerprint or digest as messages name it.
func short(fp string) string {
	if len(fp) > 16 {
		return fp[:16]
	}
	return fp
}
