package measure

import (
	"bytes"
	"crypto/sha256"
	"debug/pe"
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
)

// Authenticode is the sha256 Authenticode hash of a PE image: what UEFI
// firmware measures into PCR 4 (EV_EFI_BOOT_SERVICES_APPLICATION) for every
// EFI application it starts. It covers the headers without the CheckSum
// field and the certificate table's directory entry, then the sections in
// file order, then whatever follows them except the certificate table
// (Microsoft's "Windows Authenticode Portable Executable Signature Format").
func Authenticode(image []byte) ([]byte, error) {
	f, err := pe.NewFile(bytes.NewReader(image))
	if err != nil {
		return nil, fmt.Errorf("not a PE image: %w", err)
	}
	defer f.Close()
	if len(image) < 0x40 {
		return nil, errors.New("PE image too short")
	}
	peOff := int(binary.LittleEndian.Uint32(image[0x3c:]))
	optOff := peOff + 4 + 20
	// PE32+ and PE32 differ in the data directories' offset (112 and 96
	// bytes into the optional header); the rest is read the same.
	var sizeOfHeaders, numDirs uint32
	var dirs []pe.DataDirectory
	var certDirOff int
	switch oh := f.OptionalHeader.(type) {
	case *pe.OptionalHeader64:
		sizeOfHeaders, numDirs, dirs = oh.SizeOfHeaders, oh.NumberOfRvaAndSizes, oh.DataDirectory[:]
		certDirOff = optOff + 112 + 4*8
	case *pe.OptionalHeader32:
		sizeOfHeaders, numDirs, dirs = oh.SizeOfHeaders, oh.NumberOfRvaAndSizes, oh.DataDirectory[:]
		certDirOff = optOff + 96 + 4*8
	default:
		return nil, errors.New("PE image without an optional header")
	}
	var certOff, certSize uint32
	if numDirs > pe.IMAGE_DIRECTORY_ENTRY_SECURITY {
		d := dirs[pe.IMAGE_DIRECTORY_ENTRY_SECURITY]
		certOff, certSize = d.VirtualAddress, d.Size
	}
	checksumOff := optOff + 64
	if int(sizeOfHeaders) > len(image) || certDirOff+8 > int(sizeOfHeaders) {
		return nil, errors.New("PE headers exceed the image")
	}
	h := sha256.New()
	h.Write(image[:checksumOff])
	h.Write(image[checksumOff+4 : certDirOff])
	h.Write(image[certDirOff+8 : sizeOfHeaders])

	secs := make([]*pe.Section, 0, len(f.Sections))
	for _, s := range f.Sections {
		if s.Size > 0 {
			secs = append(secs, s)
		}
	}
	sort.Slice(secs, func(i, j int) bool { return secs[i].Offset < secs[j].Offset })
	end := uint64(sizeOfHeaders)
	for _, s := range secs {
		lo, hi := uint64(s.Offset), uint64(s.Offset)+uint64(s.Size)
		if hi > uint64(len(image)) {
			return nil, fmt.Errorf("section %s exceeds the image", s.Name)
		}
		h.Write(image[lo:hi])
		end = max(end, hi)
	}
	// Data after the last section (but not the certificate table) counts too.
	tail := uint64(len(image))
	if certSize > 0 && uint64(certOff) >= end && uint64(certOff) <= tail {
		tail = uint64(certOff)
	}
	if tail > end {
		h.Write(image[end:tail])
	}
	return h.Sum(nil), nil
}
