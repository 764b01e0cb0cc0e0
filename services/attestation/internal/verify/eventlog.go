package verify

import (
	"bytes"
	"crypto"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode"
	"unicode/utf16"

	"github.com/google/go-eventlog/register"
	"github.com/google/go-eventlog/tcg"
)

// replayLog parses a crypto-agile TCG log and replays it against the quoted
// sha256 PCRs (go-eventlog's tcg package, which go-tpm-tools uses). Events of
// PCRs the quote does not cover cannot be checked and are left out.
func replayLog(raw []byte, pcrs map[uint32][]byte) ([]Event, error) {
	el, err := parseFirmwareLog(raw)
	if err != nil {
		return nil, err
	}
	return replayFirmware(el, pcrs)
}

func parseFirmwareLog(raw []byte) (*tcg.EventLog, error) {
	el, err := tcg.ParseEventLog(raw, tcg.ParseOpts{AllowPadding: true})
	if err != nil {
		return nil, fmt.Errorf("event log does not parse: %v", err)
	}
	if !slices.Contains(el.Algs, register.HashSHA256) {
		return nil, errors.New("event log has no sha256 digests (not a crypto-agile log with a sha256 bank)")
	}
	return el, nil
}

// replayFirmware replays a parsed log against values, one per PCR.
func replayFirmware(el *tcg.EventLog, values map[uint32][]byte) ([]Event, error) {
	mrs := make([]register.MR, 0, len(values))
	for _, i := range sortedKeys(values) {
		mrs = append(mrs, register.PCR{Index: int(i), Digest: values[i], DigestAlg: crypto.SHA256})
	}
	evs, err := el.Verify(mrs)
	if err != nil {
		var re tcg.ReplayError
		if errors.As(err, &re) {
			bad := slices.Clone(re.InvalidMRs)
			slices.Sort(bad)
			return nil, fmt.Errorf("event log does not replay to the quoted value of pcrs %s", joinInts(bad))
		}
		return nil, fmt.Errorf("event log does not replay: %v", err)
	}
	out := make([]Event, 0, len(evs))
	for _, e := range evs {
		out = append(out, Event{
			PCR:         uint32(e.Index),
			Type:        e.Type.TCGString(),
			Description: describe(e.Type, e.Data),
			Digest:      bytes.Clone(e.Digest),
		})
	}
	return out, nil
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ", ")
}

// maxDesc bounds a description; logs are hostile input.
const maxDesc = 240

// describe summarizes event data for an operator. Event data is not covered
// by the replay (for images the digest is the Authenticode hash), so every
// decoder is defensive and falls back to text or hex.
func describe(t tcg.EventType, d []byte) string {
	var s string
	switch t {
	case tcg.EFIVariableDriverConfig, tcg.EFIVariableBoot, tcg.EFIVariableBoot2, tcg.EFIVariableAuthority:
		s = describeVariable(t, d)
	case tcg.EFIBootServicesApplication, tcg.EFIBootServicesDriver, tcg.EFIRuntimeServicesDriver:
		s = describeImageLoad(d)
	case tcg.EFIPlatformFirmwareBlob:
		s = describeBlob(d)
	case tcg.EFIPlatformFirmwareBlob2:
		if n, r, ok := takeDesc(d); ok {
			if b := describeBlob(r); b != "" {
				s = n + " " + b
			}
		}
	case tcg.EFIHandoffTables:
		s = describeTables(d)
	case tcg.EFIHandoffTables2:
		if n, _, ok := takeDesc(d); ok {
			s = n
		}
	case tcg.EFIGPTEvent:
		s = describeGPT(d)
	case tcg.Separator:
		switch {
		case bytes.Equal(d, []byte{0, 0, 0, 0}):
			s = "separator"
		case bytes.Equal(d, []byte{0xff, 0xff, 0xff, 0xff}):
			s = "error separator"
		}
	case tcg.EventTag:
		if len(d) >= 8 {
			id := binary.LittleEndian.Uint32(d)
			n := binary.LittleEndian.Uint32(d[4:])
			if uint64(n) == uint64(len(d)-8) {
				s = fmt.Sprintf("tag 0x%08x: %s", id, textOrHex(d[8:]))
			}
		}
	case tcg.PostCode:
		if _, ok := text(d); !ok && len(d) == 16 {
			s = describeBlob(d)
		}
	}
	if s == "" {
		s = textOrHex(d)
	}
	return clip(s)
}

// clip makes s safe to show: printable and at most maxDesc runes.
func clip(s string) string {
	s = strings.Map(func(r rune) rune {
		if unicode.IsPrint(r) {
			return r
		}
		return '?'
	}, s)
	if r := []rune(s); len(r) > maxDesc {
		return string(r[:maxDesc]) + "…"
	}
	return s
}

// textOrHex renders d as text when it is printable ASCII or UTF-16LE, else
// as short hex.
func textOrHex(d []byte) string {
	if s, ok := text(d); ok {
		return s
	}
	return shortHex(d)
}

func shortHex(d []byte) string {
	switch {
	case len(d) == 0:
		return "(empty)"
	case len(d) <= 32:
		return hex.EncodeToString(d)
	}
	return fmt.Sprintf("%s… (%d bytes)", hex.EncodeToString(d[:32]), len(d))
}

func text(d []byte) (string, bool) {
	a := bytes.TrimRight(d, "\x00")
	if len(a) == 0 {
		return "", false
	}
	ascii := true
	for _, c := range a {
		if c < 0x20 && c != '\t' && c != '\n' && c != '\r' || c > 0x7e {
			ascii = false
			break
		}
	}
	if ascii {
		return strings.Join(strings.Fields(string(a)), " "), true
	}
	if s, ok := utf16Text(d); ok {
		return s, true
	}
	return "", false
}

// utf16Text decodes NUL-terminated or unterminated UTF-16LE whose code
// units are all printable ASCII, as firmware writes its CHAR16 strings;
// anything wider is more likely binary.
func utf16Text(d []byte) (string, bool) {
	if len(d) < 2 || len(d)%2 != 0 {
		return "", false
	}
	u := make([]uint16, len(d)/2)
	for i := range u {
		u[i] = binary.LittleEndian.Uint16(d[2*i:])
	}
	for len(u) > 0 && u[len(u)-1] == 0 {
		u = u[:len(u)-1]
	}
	if len(u) == 0 {
		return "", false
	}
	for _, c := range u {
		if c < 0x20 || c > 0x7e {
			return "", false
		}
	}
	return string(utf16.Decode(u)), true
}

// utf16String decodes UTF-16LE up to the first NUL, replacing unprintable
// runes.
func utf16String(d []byte) string {
	u := make([]uint16, 0, len(d)/2)
	for i := 0; i+1 < len(d); i += 2 {
		c := binary.LittleEndian.Uint16(d[i:])
		if c == 0 {
			break
		}
		u = append(u, c)
	}
	return strings.Map(func(r rune) rune {
		if unicode.IsPrint(r) {
			return r
		}
		return '?'
	}, string(utf16.Decode(u)))
}

// guid formats an EFI_GUID (mixed-endian) as text.
func guid(b []byte) string {
	if len(b) < 16 {
		return "?"
	}
	return fmt.Sprintf("%08x-%04x-%04x-%x-%x",
		binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint16(b[4:]), binary.LittleEndian.Uint16(b[6:]), b[8:10], b[10:16])
}

const (
	efiGlobalVariable   = "8be4df61-93ca-11d2-aa0d-00e098032b8c"
	efiImageSecurityDB  = "d719b2cb-3d3a-4596-a3bc-dad00e67656f"
	maxVariableNameRune = 512
)

var wellKnownTables = map[string]string{
	"8868e871-e4f1-11d3-bc22-0080c73c8881": "ACPI 2.0",
	"eb9d2d30-2d88-11d3-9a16-0090273fc14d": "ACPI 1.0",
	"eb9d2d31-2d88-11d3-9a16-0090273fc14d": "SMBIOS",
	"f2fd1544-9794-4a2c-992e-e5bbcf20e394": "SMBIOS3",
}

// describeVariable decodes UEFI_VARIABLE_DATA: GUID, name length and data
// length (UINT64 each), the UTF-16 name, then the data.
func describeVariable(t tcg.EventType, d []byte) string {
	if len(d) < 32 {
		return ""
	}
	vendor := guid(d)
	nameLen := binary.LittleEndian.Uint64(d[16:])
	dataLen := binary.LittleEndian.Uint64(d[24:])
	rest := d[32:]
	if nameLen > maxVariableNameRune || nameLen*2 > uint64(len(rest)) {
		return ""
	}
	name := utf16String(rest[:nameLen*2])
	rest = rest[nameLen*2:]
	if dataLen > uint64(len(rest)) {
		return ""
	}
	val := rest[:dataLen]

	s := name
	if vendor != efiGlobalVariable && vendor != efiImageSecurityDB {
		s += " {" + vendor + "}"
	}
	switch {
	case t == tcg.EFIVariableAuthority:
		// EFI_SIGNATURE_DATA: owner GUID, then usually an X.509 certificate.
		if len(val) > 16 {
			if c, err := x509.ParseCertificate(val[16:]); err == nil {
				return s + ": " + c.Subject.String()
			}
		}
	case name == "BootOrder" && len(val)%2 == 0:
		var ids []string
		for i := 0; i+1 < len(val) && len(ids) < 32; i += 2 {
			ids = append(ids, fmt.Sprintf("%04X", binary.LittleEndian.Uint16(val[i:])))
		}
		return s + " = " + strings.Join(ids, ",")
	case isBootOption(name):
		if lo := describeLoadOption(val); lo != "" {
			return s + ": " + lo
		}
	}
	if len(val) <= 8 {
		return s + " = " + shortHex(val)
	}
	return fmt.Sprintf("%s (%d bytes)", s, len(val))
}

func isBootOption(name string) bool {
	if len(name) != 8 || !strings.HasPrefix(name, "Boot") {
		return false
	}
	_, err := hex.DecodeString(name[4:])
	return err == nil
}

// describeLoadOption decodes EFI_LOAD_OPTION: attributes (UINT32), file path
// list length (UINT16), NUL-terminated UTF-16 description, device path.
func describeLoadOption(d []byte) string {
	if len(d) < 6 {
		return ""
	}
	fpLen := int(binary.LittleEndian.Uint16(d[4:]))
	rest := d[6:]
	end := -1
	for i := 0; i+1 < len(rest); i += 2 {
		if rest[i] == 0 && rest[i+1] == 0 {
			end = i
			break
		}
	}
	if end < 0 {
		return ""
	}
	desc := utf16String(rest[:end])
	rest = rest[end+2:]
	if fpLen > len(rest) {
		return desc
	}
	if p := devicePath(rest[:fpLen]); p != "" {
		return desc + " (" + p + ")"
	}
	return desc
}

// describeImageLoad decodes UEFI_IMAGE_LOAD_EVENT: location, length and
// link-time address (UINT64 each), device path length (UINT64), device path.
func describeImageLoad(d []byte) string {
	if len(d) < 32 {
		return ""
	}
	n := binary.LittleEndian.Uint64(d[24:])
	if n > uint64(len(d)-32) {
		return ""
	}
	if p := devicePath(d[32 : 32+n]); p != "" {
		return p
	}
	return fmt.Sprintf("image at 0x%x, length 0x%x", binary.LittleEndian.Uint64(d), binary.LittleEndian.Uint64(d[8:]))
}

// describeBlob decodes UEFI_PLATFORM_FIRMWARE_BLOB: base and length.
func describeBlob(d []byte) string {
	if len(d) != 16 {
		return ""
	}
	return fmt.Sprintf("base 0x%x, length 0x%x", binary.LittleEndian.Uint64(d), binary.LittleEndian.Uint64(d[8:]))
}

// takeDesc splits the UINT8-sized description that starts the *2 events.
func takeDesc(d []byte) (string, []byte, bool) {
	if len(d) < 1 || int(d[0]) > len(d)-1 {
		return "", nil, false
	}
	n := int(d[0])
	s, ok := text(d[1 : 1+n])
	if !ok {
		s = shortHex(d[1 : 1+n])
	}
	return s, d[1+n:], true
}

// describeTables decodes UEFI_HANDOFF_TABLE_POINTERS: count (UINT64), then
// (GUID, pointer) pairs.
func describeTables(d []byte) string {
	if len(d) < 8 {
		return ""
	}
	n := binary.LittleEndian.Uint64(d)
	d = d[8:]
	if n > uint64(len(d)/24) {
		return ""
	}
	var names []string
	for i := uint64(0); i < n && i < 8; i++ {
		g := guid(d[i*24:])
		if w, ok := wellKnownTables[g]; ok {
			g = w
		}
		names = append(names, g)
	}
	return "tables " + strings.Join(names, ", ")
}

// describeGPT decodes UEFI_GPT_DATA: the 92-byte partition table header
// (disk GUID at offset 56), then the partition count (UINT64).
func describeGPT(d []byte) string {
	if len(d) < 100 || string(d[:8]) != "EFI PART" {
		return ""
	}
	return fmt.Sprintf("gpt disk %s, %d partitions", guid(d[56:]), binary.LittleEndian.Uint64(d[92:]))
}

// devicePath renders an EFI device path in the UEFI text style for the node
// types firmware logs carry; others become Path(type,subtype).
func devicePath(d []byte) string {
	var parts []string
	for len(d) >= 4 && len(parts) < 16 {
		typ, sub := d[0], d[1]
		n := int(binary.LittleEndian.Uint16(d[2:]))
		if n < 4 || n > len(d) {
			parts = append(parts, "…")
			break
		}
		b := d[4:n]
		d = d[n:]
		var p string
		switch {
		case typ == 0x7f:
			// End of the path or of its first instance.
			return strings.Join(parts, "/")
		case typ == 1 && sub == 1 && len(b) >= 2:
			p = fmt.Sprintf("Pci(0x%x,0x%x)", b[1], b[0])
		case typ == 1 && sub == 4 && len(b) >= 16:
			p = "VenHw(" + guid(b) + ")"
		case typ == 2 && sub == 1 && len(b) >= 8:
			hid, uid := binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint32(b[4:])
			switch hid {
			case 0x0a0341d0:
				p = fmt.Sprintf("PciRoot(0x%x)", uid)
			case 0x0a0841d0:
				p = fmt.Sprintf("PcieRoot(0x%x)", uid)
			default:
				p = fmt.Sprintf("Acpi(0x%08x,0x%x)", hid, uid)
			}
		case typ == 3 && sub == 2 && len(b) >= 4:
			p = fmt.Sprintf("Scsi(0x%x,0x%x)", binary.LittleEndian.Uint16(b), binary.LittleEndian.Uint16(b[2:]))
		case typ == 3 && sub == 0x12 && len(b) >= 6:
			p = fmt.Sprintf("Sata(0x%x,0x%x,0x%x)", binary.LittleEndian.Uint16(b), binary.LittleEndian.Uint16(b[2:]), binary.LittleEndian.Uint16(b[4:]))
		case typ == 3 && sub == 0x17 && len(b) >= 4:
			p = fmt.Sprintf("NVMe(0x%x)", binary.LittleEndian.Uint32(b))
		case typ == 3 && sub == 0x0a && len(b) >= 16:
			p = "VenMsg(" + guid(b) + ")"
		case typ == 4 && sub == 1 && len(b) >= 38:
			num := binary.LittleEndian.Uint32(b)
			switch b[37] {
			case 2:
				p = fmt.Sprintf("HD(%d,GPT,%s)", num, guid(b[20:]))
			case 1:
				p = fmt.Sprintf("HD(%d,MBR,0x%08x)", num, binary.LittleEndian.Uint32(b[20:]))
			default:
				p = fmt.Sprintf("HD(%d)", num)
			}
		case typ == 4 && sub == 2 && len(b) >= 4:
			p = fmt.Sprintf("CDROM(0x%x)", binary.LittleEndian.Uint32(b))
		case typ == 4 && sub == 3 && len(b) >= 16:
			p = "VenMedia(" + guid(b) + ")"
		case typ == 4 && sub == 4:
			p = utf16String(b)
		case typ == 4 && sub == 6 && len(b) >= 16:
			p = "FvFile(" + guid(b) + ")"
		case typ == 4 && sub == 7 && len(b) >= 16:
			p = "Fv(" + guid(b) + ")"
		case typ == 4 && sub == 8 && len(b) >= 20:
			p = fmt.Sprintf("Offset(0x%x,0x%x)", binary.LittleEndian.Uint64(b[4:]), binary.LittleEndian.Uint64(b[12:]))
		default:
			p = fmt.Sprintf("Path(%d,%d)", typ, sub)
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, "/")
}
