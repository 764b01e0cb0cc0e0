// Package smbios reads the systemd-style credentials a host passes in SMBIOS type 11
// (OEM strings) structures, as exposed by Linux under /sys/firmware/dmi/entries.
package smbios

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// TypeOEMStrings is the SMBIOS structure type that carries OEM strings.
const TypeOEMStrings = 11

// DefaultEntriesDir is where Linux exposes the raw DMI structures.
const DefaultEntriesDir = "/sys/firmware/dmi/entries"

const (
	textPrefix   = "io.systemd.credential:"
	binaryPrefix = "io.systemd.credential.binary:"
)

// Structure is one parsed SMBIOS structure.
type Structure struct {
	Type      uint8
	Handle    uint16
	Formatted []byte   // the formatted area after the 4-byte header
	Strings   []string // the string table; SMBIOS string number n is Strings[n-1]
}

// Parse parses one SMBIOS structure: a 4-byte header (type, length, handle), the rest of
// the formatted area, then NUL-terminated strings ending in a double NUL.
func Parse(b []byte) (Structure, error) {
	if len(b) < 4 {
		return Structure{}, errors.New("smbios: structure shorter than its header")
	}
	length := int(b[1])
	if length < 4 {
		return Structure{}, fmt.Errorf("smbios: header length %d < 4", length)
	}
	if len(b) < length {
		return Structure{}, fmt.Errorf("smbios: structure truncated: length %d, have %d bytes", length, len(b))
	}
	s := Structure{
		Type:      b[0],
		Handle:    uint16(b[2]) | uint16(b[3])<<8,
		Formatted: bytes.Clone(b[4:length]),
	}
	table := b[length:]
	// A structure without strings still ends in two NULs.
	if len(table) >= 2 && table[0] == 0 && table[1] == 0 {
		return s, nil
	}
	for {
		i := bytes.IndexByte(table, 0)
		if i < 0 {
			return Structure{}, errors.New("smbios: string table not terminated")
		}
		if i == 0 {
			return s, nil // the second NUL of the terminating pair
		}
		s.Strings = append(s.Strings, string(table[:i]))
		table = table[i+1:]
	}
}

// OEMStrings returns the strings of a type 11 structure, honouring its Count field.
func OEMStrings(s Structure) ([]string, error) {
	if s.Type != TypeOEMStrings {
		return nil, fmt.Errorf("smbios: type %d is not OEM strings", s.Type)
	}
	if len(s.Formatted) < 1 {
		return nil, errors.New("smbios: type 11 without a count")
	}
	n := int(s.Formatted[0])
	if n > len(s.Strings) {
		return nil, fmt.Errorf("smbios: type 11 count %d, but %d strings", n, len(s.Strings))
	}
	return s.Strings[:n], nil
}

// ParseCredential splits one OEM string of the form io.systemd.credential:<name>=<value>
// or io.systemd.credential.binary:<name>=<base64>. ok is false for other OEM strings.
func ParseCredential(s string) (name string, value []byte, ok bool, err error) {
	var binary bool
	var rest string
	switch {
	case strings.HasPrefix(s, binaryPrefix):
		binary, rest = true, s[len(binaryPrefix):]
	case strings.HasPrefix(s, textPrefix):
		rest = s[len(textPrefix):]
	default:
		return "", nil, false, nil
	}
	name, v, found := strings.Cut(rest, "=")
	if !found || name == "" || strings.ContainsAny(name, "/:") {
		return "", nil, true, fmt.Errorf("smbios: malformed credential %q", truncate(s))
	}
	if !binary {
		return name, []byte(v), true, nil
	}
	dec, err := base64.StdEncoding.DecodeString(v)
	if err != nil {
		return "", nil, true, fmt.Errorf("smbios: credential %s: %w", name, err)
	}
	return name, dec, true, nil
}

// Credentials collects the credentials from raw type 11 structures. A later duplicate
// overrides an earlier one. Malformed entries are returned as errors alongside the
// credentials that did parse, so one bad string does not hide the others.
func Credentials(raws ...[]byte) (map[string][]byte, []error) {
	creds := map[string][]byte{}
	var errs []error
	for _, raw := range raws {
		s, err := Parse(raw)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		strs, err := OEMStrings(s)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, str := range strs {
			name, val, ok, err := ParseCredential(str)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			if ok {
				creds[name] = val
			}
		}
	}
	return creds, errs
}

// ReadCredentials reads every type 11 structure under dir (normally
// DefaultEntriesDir, where entries are named <type>-<instance>). A missing dir means
// no credentials, not an error.
func ReadCredentials(dir string) (map[string][]byte, []error) {
	paths, _ := filepath.Glob(filepath.Join(dir, fmt.Sprintf("%d-*", TypeOEMStrings), "raw"))
	sort.Strings(paths)
	var raws [][]byte
	var errs []error
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		raws = append(raws, b)
	}
	creds, perrs := Credentials(raws...)
	return creds, append(errs, perrs...)
}

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}
