package policy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/types/known/structpb"
)

// GoldenPCRsFor are the PCRs that must have a golden value (or be learned)
// at a stage: the firmware PCRs but 0, PCR 9 for a direct-kernel image (OVMF
// measures its initrd and command line there), and PCR 13 (the Kubernetes
// sysext) at ready. PCR 0 is not among them: OVMF's value depends on the
// VM's memory size and vCPU count (it measures its PEI volume after using
// it), so one golden value cannot hold for every VM of an image; the
// firmware build is checked by its identity instead (golden_firmware, see
// the verifier). A policy that has a golden PCR 0 still gets it compared.
// docs/attestation.md lists every PCR and why it is, or is not, compared.
func GoldenPCRsFor(stage attestationv1.Stage, directKernel bool) []uint32 {
	out := []uint32{2, 3, 4, 6, 7}
	if directKernel {
		out = append(out, 9)
	}
	if stage == attestationv1.Stage_STAGE_READY {
		out = append(out, 13)
	}
	return out
}

// NeverCompared are quoted and recorded only: PCR 1 holds the EFI boot
// variables (BootOrder, Boot####), which a guest with root writes through
// the firmware's runtime services, and SMBIOS data that differs per VM by
// construction (credentials, serial); PCR 5 holds the disk's partition table
// and boot-variable data, which a guest rewrites at will. Neither says what
// code ran: PCR 4 (the binaries loaded), 9 and 11 do.
var NeverCompared = []uint32{1, 5}

// Phase is the PCR 11 phase checked at a stage.
func Phase(stage attestationv1.Stage) string {
	if stage == attestationv1.Stage_STAGE_READY {
		return PhaseReady
	}
	return PhaseInitrd
}

// Outcome is the policy half of a verdict.
type Outcome struct {
	// Learned lists PCRs accepted without a golden value (learn mode).
	Learned []uint32
	// Mismatched lists PCRs whose golden value differs, for naming events
	// from the stored golden boot. It leaves out PCR 13 when the policy's
	// sysext says what its events are.
	Mismatched []uint32
	// MismatchedEvents are the PCR 11, 13 and 15 events that differ from
	// what the policy's uki.sections, sysext and oci say, when the logs
	// replay.
	MismatchedEvents []*attestationv1.EventMismatch
	// Reason is set when the quote is rejected.
	Reason string
	// Summary is the success message's policy part.
	Summary string
	// OCI is the OCI image a verified quote's PCR 15 showed the guest
	// booted, when the policy is an imported OCI image's.
	OCI *attestationv1.OciImage
}

// Evaluate compares quoted PCRs with a policy document (contract §5.4 steps
// 12 and 13). Golden values for PCRs beyond the required set (PCR 9, which
// measures a direct-kernel image's command line and initrd under OVMF) are
// compared too, and the quote must cover them.
//
// events are the quote's replayed log events: nil when no log was given or
// one did not replay. With them, a PCR 11 or 13 mismatch names its first
// differing event from the events the policy's uki.sections or sysext
// expect; without them, or when they do not extend the PCR to its quoted
// value, the reason names none.
//
// cmdlineExtra is what the host asked systemd-stub to append to the command
// line on this boot through SMBIOS ("ignition.firstboot" on a first boot): a
// golden PCR 12 may then be extended by it, on this boot only.
//
// A policy with an oci object (an imported OCI image) also needs PCR 15
// quoted and holding the verity root word of its root_hash alone, at both
// stages and in learn mode too; a mismatch names the root hash the guest
// measured when the userspace log replays (verityRoot).
func Evaluate(doc *structpb.Struct, stage attestationv1.Stage, kubernetesVersion string, directKernel bool, cmdlineExtra string, pcrs map[uint32][]byte, events []verify.Event, learn bool) Outcome {
	f := doc.GetFields()
	var out Outcome
	phase := Phase(stage)
	summary := []string{}
	if p11 := f["pcr11"].GetStructValue(); p11 != nil {
		want := p11.GetFields()[phase].GetStringValue()
		if got := pcrs[11]; !equalHex(want, got) {
			out.Reason = fmt.Sprintf("pcr 11 mismatch for phase %s: expected %s, got %x", phase, want, got)
			if sections, ok := sectionDigests(doc); ok && events != nil {
				if exp, err := measure.PCR11Events(sections, phase); err == nil {
					if ms, first, ok := nameEvents(11, exp, 2*len(sections), events, got); ok {
						out.MismatchedEvents = ms
						out.Reason += "; first differing event: " + first
					}
				}
			}
			return out
		}
		summary = append(summary, "pcr 11 phase "+phase)
	}
	golden := f["golden"].GetStructValue().GetFields()["sha256"].GetStructValue().GetFields()
	var mismatches, missing []string
	check := func(idx uint32, want string, suffix string) {
		// On a boot the host appended to, PCR 12 holds the extra as systemd-stub
		// 254 and later measure it, or the golden value where the stub ignores
		// it (252): either way the guest has not run before and cannot have
		// added anything. On other boots only the golden value counts.
		if idx == measure.PCRParameters && cmdlineExtra != "" && !equalHex(want, pcrs[idx]) {
			if w, err := hex.DecodeString(want); err == nil && len(w) == sha256.Size {
				want = hex.EncodeToString(measure.Extend(w, measure.CmdlineExtraEvent(cmdlineExtra).Digest))
				suffix += fmt.Sprintf(" (the golden value extended by the host's command line extra %q)", cmdlineExtra)
			}
		}
		got, quoted := pcrs[idx]
		switch {
		case !quoted:
			mismatches = append(mismatches, fmt.Sprintf("pcr %d has a golden value but was not quoted", idx))
		case !equalHex(want, got):
			mismatches = append(mismatches, fmt.Sprintf("pcr %d expected %s, got %x%s", idx, strings.ToLower(want), got, suffix))
			out.Mismatched = append(out.Mismatched, idx)
		}
	}
	// A PCR 4 that differs names the EFI applications that are not the
	// image's (uki.authenticode), when the log replays.
	suffix := map[uint32]string{}
	if want, ok := golden["4"]; ok {
		if got, quoted := pcrs[4]; quoted && !equalHex(want.GetStringValue(), got) {
			if ms, first, ok := foreignApplications(doc, events, got); ok {
				out.MismatchedEvents = append(out.MismatchedEvents, ms...)
				suffix[4] = "; first differing event: " + first
			}
		}
	}
	required := GoldenPCRsFor(stage, directKernel)
	for _, idx := range required {
		if idx == 13 {
			continue
		}
		want, ok := golden[strconv.Itoa(int(idx))]
		if !ok {
			missing = append(missing, strconv.Itoa(int(idx)))
			continue
		}
		check(idx, want.GetStringValue(), suffix[idx])
	}
	if suffix[4] != "" {
		// The policy named PCR 4's events; a stored golden boot need not.
		out.Mismatched = slices.DeleteFunc(out.Mismatched, func(i uint32) bool { return i == 4 })
	}
	// Further golden values (e.g. PCR 9 of a direct-kernel image).
	var extra []uint32
	for k := range golden {
		n, err := strconv.Atoi(k)
		// PCR 13 is the ready stage's alone, handled below.
		if err == nil && n != 13 && !slices.Contains(required, uint32(n)) && !slices.Contains(NeverCompared, uint32(n)) {
			extra = append(extra, uint32(n))
		}
	}
	slices.Sort(extra)
	for _, idx := range extra {
		// A guest must not dodge a golden value by leaving its PCR out.
		check(idx, golden[strconv.Itoa(int(idx))].GetStringValue(), "")
	}
	if stage == attestationv1.Stage_STAGE_READY {
		want, suffix := "", ""
		line, sysext := "", false
		if v := f["pcr13"].GetStructValue().GetFields()[kubernetesVersion]; kubernetesVersion != "" && v != nil {
			want, suffix = v.GetStringValue(), " for kubernetes "+kubernetesVersion
			line, sysext = sysextLine(doc, kubernetesVersion)
		} else if v, ok := golden["13"]; ok {
			want = v.GetStringValue()
		}
		if want != "" {
			if got, quoted := pcrs[13]; sysext && quoted && !equalHex(want, got) && events != nil {
				if ms, first, ok := nameEvents(13, measure.PCR13Events(line), 0, events, got); ok {
					out.MismatchedEvents = append(out.MismatchedEvents, ms...)
					suffix += "; first differing event: " + first
				}
			}
			check(13, want, suffix)
			if sysext {
				// The policy says what PCR 13's events are; the stored
				// golden boot may have run another sysext.
				out.Mismatched = slices.DeleteFunc(out.Mismatched, func(i uint32) bool { return i == 13 })
			}
			if kubernetesVersion != "" {
				summary = append(summary, "pcr 13 kubernetes "+kubernetesVersion)
			}
		}
		// PCR 13 without an expected value is accepted and recorded.
	}
	// An OCI image's root: PCR 15, at every stage, learn mode or not.
	img, rootReason, rootEvents := verityRoot(doc, pcrs, events)
	out.MismatchedEvents = append(out.MismatchedEvents, rootEvents...)
	if len(mismatches) > 0 {
		out.Reason = "golden mismatch: " + strings.Join(mismatches, "; ")
		if rootReason != "" {
			out.Reason += "; " + rootReason
		}
		return out
	}
	if rootReason != "" {
		out.Reason = rootReason
		return out
	}
	if img != nil {
		summary = append(summary, fmt.Sprintf("oci %s root %s", img.Name(), img.RootHash))
	}
	if len(missing) > 0 {
		if !learn {
			out.Reason = fmt.Sprintf("no golden value for pcr %s in the image policy: record one with RecordGolden (POST /api/v1/images/<image>/policy/golden) or run with --attestation-learn-golden", strings.Join(missing, ", "))
			return out
		}
		for _, m := range missing {
			n, _ := strconv.Atoi(m)
			out.Learned = append(out.Learned, uint32(n))
		}
	}
	out.Summary = strings.Join(summary, ", ")
	if img != nil {
		out.OCI = img.Proto()
	}
	return out
}

func equalHex(want string, got []byte) bool {
	w, err := hex.DecodeString(want)
	return err == nil && bytes.Equal(w, got)
}
