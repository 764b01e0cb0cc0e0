package verify

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/google/go-eventlog/tcg"
	"github.com/google/go-tpm/legacy/tpm2"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
)

func TestEventLogReplays(t *testing.T) {
	f := getFixture(t)
	nonce := newNonce(t)
	q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
	q.Stage = ready
	q.EventLog = f.log
	res := mustVerify(t, q, nonce)
	if res.EventLogError != "" {
		t.Fatalf("EventLogError = %q", res.EventLogError)
	}

	// Every boot event of a quoted PCR, in log order; PCR 8 is not quoted.
	var want []testEvent
	for _, e := range bootEvents {
		if e.pcr != 8 {
			want = append(want, e)
		}
	}
	if len(res.Events) != len(want) {
		t.Fatalf("got %d events, want %d: %+v", len(res.Events), len(want), res.Events)
	}
	for i, e := range res.Events {
		sum := sha256.Sum256(want[i].measured())
		if e.PCR != want[i].pcr || !bytes.Equal(e.Digest, sum[:]) {
			t.Errorf("event %d = pcr %d digest %x, want pcr %d digest %x", i, e.PCR, e.Digest, want[i].pcr, sum)
		}
	}

	wantDesc := []struct{ typ, desc string }{
		{"EV_S_CRTM_VERSION", "1.00"},
		{"EV_EFI_PLATFORM_FIRMWARE_BLOB", "base 0xffc84000, length 0x348000"},
		{"EV_EFI_PLATFORM_FIRMWARE_BLOB2", "Fv(PEIFV) base 0x820000, length 0xe0000"},
		{"EV_EFI_VARIABLE_BOOT", "BootOrder = 0001,0000"},
		{"EV_EFI_VARIABLE_BOOT", `Boot0001: UEFI QEMU HARDDISK QM00001 (PciRoot(0x0)/Pci(0x4,0x0)/HD(1,GPT,11223344-5566-7788-99aa-bbccddeeff00)/\EFI\BOOT\BOOTX64.EFI)`},
		{"EV_EFI_HANDOFF_TABLES2", "SMBIOS3"},
		{"EV_EFI_ACTION", "Calling EFI Application from Boot Option"},
		{"EV_EFI_BOOT_SERVICES_APPLICATION", `PciRoot(0x0)/Pci(0x4,0x0)/HD(1,GPT,11223344-5566-7788-99aa-bbccddeeff00)/\EFI\BOOT\BOOTX64.EFI`},
		{"EV_EFI_GPT_EVENT", "gpt disk 11223344-5566-7788-99aa-bbccddeeff00, 0 partitions"},
		{"EV_EVENT_TAG", "tag 0x8f3b22ed: Linux initrd"},
		{"EV_EFI_VARIABLE_DRIVER_CONFIG", "SecureBoot = 00"},
		{"EV_EFI_VARIABLE_DRIVER_CONFIG", "PK = (empty)"},
	}
	for i, w := range wantDesc {
		if e := res.Events[i]; e.Type != w.typ || e.Description != w.desc {
			t.Errorf("event %d = %s %q, want %s %q", i, e.Type, e.Description, w.typ, w.desc)
		}
	}
	for _, e := range res.Events[len(wantDesc):] {
		if e.Type != "EV_SEPARATOR" || e.Description != "separator" {
			t.Errorf("event = %s %q, want a separator", e.Type, e.Description)
		}
	}

	// The same log against the same PCRs: nothing differs.
	if m := Mismatches(res.Events, res.Events, nil); len(m) != 0 {
		t.Errorf("Mismatches of identical logs = %v", m)
	}
}

func TestEventLogUnusable(t *testing.T) {
	f := getFixture(t)
	changed := append([]testEvent(nil), bootEvents...)
	changed[7].meas = []byte("authenticode hash of another BOOTX64.EFI")
	noSHA256 := buildLog(bootEvents, sha1Alg)

	for _, tc := range []struct {
		name, want string
		log        []byte
	}{
		{"changed boot loader", "event log does not replay to the quoted value of pcrs 4", buildLog(changed, sha1Alg, sha256Alg)},
		{"extra event", "event log does not replay to the quoted value of pcrs 7", buildLog(append(bootEvents[:len(bootEvents):len(bootEvents)], testEvent{pcr: 7, typ: evSeparator, data: separator}), sha1Alg, sha256Alg)},
		{"sha1 only", "event log has no sha256 digests", noSHA256},
		{"truncated", "event log does not parse", f.log[:len(f.log)-3]},
		{"garbage", "event log does not parse", []byte("this is not an event log")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nonce := newNonce(t)
			q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
			q.Stage = ready
			q.EventLog = tc.log
			res := mustVerify(t, q, nonce) // the quote itself still verifies
			if !strings.Contains(res.EventLogError, tc.want) {
				t.Errorf("EventLogError = %q, want %q", res.EventLogError, tc.want)
			}
			if res.Events != nil {
				t.Errorf("Events = %v, want nil", res.Events)
			}
		})
	}
}

func ev(pcr uint32, typ, desc string, digest byte) Event {
	return Event{PCR: pcr, Type: typ, Description: desc, Digest: bytes.Repeat([]byte{digest}, 32)}
}

func TestMismatches(t *testing.T) {
	golden := []Event{
		ev(0, "EV_EFI_PLATFORM_FIRMWARE_BLOB", "base 0x820000, length 0xe0000", 1),
		ev(4, "EV_EFI_ACTION", "Calling EFI Application from Boot Option", 2),
		ev(4, "EV_EFI_BOOT_SERVICES_APPLICATION", `\EFI\BOOT\BOOTX64.EFI`, 3),
		ev(7, "EV_EFI_VARIABLE_DRIVER_CONFIG", "SecureBoot = 01", 4),
		ev(7, "EV_SEPARATOR", "separator", 5),
	}
	current := []Event{
		ev(0, "EV_EFI_PLATFORM_FIRMWARE_BLOB", "base 0x820000, length 0xe0000", 1),
		ev(4, "EV_EFI_ACTION", "Calling EFI Application from Boot Option", 2),
		ev(4, "EV_EFI_BOOT_SERVICES_APPLICATION", `\EFI\BOOT\BOOTX64.EFI`, 9), // changed
		ev(4, "EV_EFI_BOOT_SERVICES_APPLICATION", `\EFI\Linux\extra.efi`, 8),  // added
		ev(7, "EV_EFI_VARIABLE_DRIVER_CONFIG", "SecureBoot = 01", 4),
		// pcr 7 separator removed
	}
	h := func(b byte) string { return hex.EncodeToString(bytes.Repeat([]byte{b}, 32)) }
	want := []*attestationv1.EventMismatch{
		{Pcr: 4, Type: "EV_EFI_BOOT_SERVICES_APPLICATION", Description: `\EFI\BOOT\BOOTX64.EFI`, Digest: h(9), ExpectedDigest: h(3)},
		{Pcr: 4, Type: "EV_EFI_BOOT_SERVICES_APPLICATION", Description: `\EFI\Linux\extra.efi`, Digest: h(8)},
		{Pcr: 7, Type: "EV_SEPARATOR", Description: "separator", ExpectedDigest: h(5)},
	}
	check := func(name string, got []*attestationv1.EventMismatch, want []*attestationv1.EventMismatch) {
		t.Helper()
		if len(got) != len(want) {
			t.Fatalf("%s: got %d mismatches %v, want %d", name, len(got), got, len(want))
		}
		for i := range want {
			g, w := got[i], want[i]
			if g.GetPcr() != w.GetPcr() || g.GetType() != w.GetType() || g.GetDescription() != w.GetDescription() ||
				g.GetDigest() != w.GetDigest() || g.GetExpectedDigest() != w.GetExpectedDigest() {
				t.Errorf("%s: mismatch %d = %v, want %v", name, i, g, w)
			}
		}
	}
	check("all", Mismatches(golden, current, nil), want)
	check("pcr 7, 4 unsorted", Mismatches(golden, current, []uint32{7, 4, 7}), want)
	check("pcr 4", Mismatches(golden, current, []uint32{4}), want[:2])
	check("pcr 0", Mismatches(golden, current, []uint32{0, 13}), nil)
}

func TestDescribe(t *testing.T) {
	long := bytes.Repeat([]byte{0xab}, 40)
	for _, tc := range []struct {
		typ  tcg.EventType
		data []byte
		want string
	}{
		{tcg.Separator, []byte{0xff, 0xff, 0xff, 0xff}, "error separator"},
		{tcg.Separator, []byte{1, 2}, "0102"},
		{tcg.PostCode, []byte("ACPI DATA"), "ACPI DATA"},
		{tcg.PostCode, append(le64(0x800000), le64(0x1000)...), "base 0x800000, length 0x1000"},
		{tcg.EFIAction, []byte("Exit Boot Services Invocation"), "Exit Boot Services Invocation"},
		{tcg.Ipl, ucs2("console=ttyS0 root=LABEL=ROOT", true), "console=ttyS0 root=LABEL=ROOT"},
		{tcg.Ipl, []byte("multi\nline\x00"), "multi line"},
		{tcg.CompactHash, long, "abababababababababababababababababababababababababababababababab… (40 bytes)"},
		{tcg.EventType(0x1234), []byte{0, 1, 2}, "000102"},
		{tcg.EventType(0x1234), nil, "(empty)"},
		{tcg.EFIHandoffTables, append(le64(1), append(guidBytes(0xf2fd1544, 0x9794, 0x4a2c, [8]byte{0x99, 0x2e, 0xe5, 0xbb, 0xcf, 0x20, 0xe3, 0x94}), le64(0x7f000000)...)...), "tables SMBIOS3"},
		{tcg.EFIBootServicesApplication, imageLoad(append(node(4, 7, diskGUID), append(node(4, 6, diskGUID), endNode...)...)), "Fv(11223344-5566-7788-99aa-bbccddeeff00)/FvFile(11223344-5566-7788-99aa-bbccddeeff00)"},
		{tcg.EFIBootServicesApplication, imageLoad(nil), "image at 0x7e000000, length 0x20000"},
		{tcg.EFIBootServicesApplication, imageLoad([]byte{4, 4, 2, 0}), "…"},
		{tcg.EFIVariableDriverConfig, variable(diskGUID, "Custom", []byte{1, 2, 3, 4, 5, 6, 7, 8, 9}), "Custom {11223344-5566-7788-99aa-bbccddeeff00} (9 bytes)"},
		{tcg.EFIVariableDriverConfig, variable(globalVar, "SecureBoot", nil)[:40], "61dfe48bca93d211"}, // truncated: falls back to hex
		{tcg.EFIVariableAuthority, variable(globalVar, "db", []byte("not a certificate at all")), "db (24 bytes)"},
	} {
		got := describe(tc.typ, tc.data)
		if !strings.HasPrefix(got, tc.want) {
			t.Errorf("describe(%s, %x) = %q, want %q", tc.typ.TCGString(), tc.data, got, tc.want)
		}
	}
	if got := describe(tcg.Ipl, bytes.Repeat([]byte("a"), 1000)); len([]rune(got)) != maxDesc+1 {
		t.Errorf("long description not clipped: %d runes", len([]rune(got)))
	}
}
