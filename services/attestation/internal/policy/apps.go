package policy

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strings"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/types/known/structpb"
)

// typeApplication is how the firmware logs an EFI application it starts:
// its digest is the application's Authenticode hash.
const typeApplication = "EV_EFI_BOOT_SERVICES_APPLICATION"

// applications are the Authenticode hashes of the EFI applications a boot of
// the image starts (uki.authenticode: the UKI, the kernel systemd-stub
// loads), by name; ok is false when the document has none.
func applications(doc *structpb.Struct) (map[string][]byte, bool) {
	m := doc.GetFields()["uki"].GetStructValue().GetFields()["authenticode"].GetStructValue()
	if m == nil || len(m.GetFields()) == 0 {
		return nil, false
	}
	out := map[string][]byte{}
	for name, v := range m.GetFields() {
		d, err := hex.DecodeString(v.GetStringValue())
		if err != nil || len(d) != 32 {
			return nil, false
		}
		out[name] = d
	}
	return out, true
}

// foreignApplications names the EFI applications in PCR 4 that are not the
// image's: another boot loader before the UKI, a different UKI, a shell.
// Like nameEvents it names nothing unless the replayed PCR 4 events extend
// it from zero to its quoted value. first is the reason's part.
func foreignApplications(doc *structpb.Struct, replayed []verify.Event, quoted []byte) (ms []*attestationv1.EventMismatch, first string, ok bool) {
	apps, ok := applications(doc)
	if !ok || replayed == nil {
		return nil, "", false
	}
	fold := measure.Zero()
	for _, e := range replayed {
		if e.PCR == 4 {
			fold = measure.Extend(fold, e.Digest)
		}
	}
	if !bytes.Equal(fold, quoted) {
		return nil, "", false
	}
	for _, e := range replayed {
		if e.PCR != 4 || e.Type != typeApplication || slices.ContainsFunc(slices.Collect(maps.Values(apps)), func(d []byte) bool { return bytes.Equal(d, e.Digest) }) {
			continue
		}
		ms = append(ms, &attestationv1.EventMismatch{Pcr: 4, Type: e.Type, Description: e.Description, Digest: hex.EncodeToString(e.Digest)})
		if first == "" {
			first = fmt.Sprintf("EFI application %s (authenticode %s) is not the image's (%s)", e.Description, short(e.Digest), knownApplications(apps))
		}
	}
	return ms, first, len(ms) > 0
}

func knownApplications(apps map[string][]byte) string {
	var s []string
	for _, name := range slices.Sorted(maps.Keys(apps)) {
		s = append(s, name+" "+short(apps[name]))
	}
	return strings.Join(s, ", ")
}
