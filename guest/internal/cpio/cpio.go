// Package cpio writes "newc" (SVR4, no CRC) cpio archives, the format the Linux kernel
// unpacks as an initramfs. Only what an initramfs needs: no hard links, no CRC.
package cpio

import (
	"errors"
	"fmt"
	"io"
	"strings"
)

// File type bits of Mode (as in stat(2)).
const (
	TypeMask = 0o170000
	TypeDir  = 0o040000
	TypeReg  = 0o100000
	TypeLink = 0o120000
	TypeChar = 0o020000
)

// Trailer is the name of the entry that ends an archive.
const Trailer = "TRAILER!!!"

const magic = "070701"

// Entry is one archive member. Owner, group and mtime are always 0: archives depend
// only on their content.
type Entry struct {
	Name         string // relative, without a leading slash
	Mode         uint32 // type bits | permissions
	Data         []byte // file content or symlink target
	Major, Minor uint32 // device number, for device nodes
}

func Dir(name string, perm uint32) Entry { return Entry{Name: name, Mode: TypeDir | perm} }
func File(name string, perm uint32, data []byte) Entry {
	return Entry{Name: name, Mode: TypeReg | perm, Data: data}
}
func Symlink(name, target string) Entry {
	return Entry{Name: name, Mode: TypeLink | 0o777, Data: []byte(target)}
}
func CharDev(name string, perm, major, minor uint32) Entry {
	return Entry{Name: name, Mode: TypeChar | perm, Major: major, Minor: minor}
}

// Writer writes entries in the order given, numbering inodes from 1.
type Writer struct {
	w      io.Writer
	ino    uint32
	closed bool
}

func NewWriter(w io.Writer) *Writer { return &Writer{w: w} }

// WriteEntry appends e.
func (w *Writer) WriteEntry(e Entry) error {
	if w.closed {
		return errors.New("cpio: write after close")
	}
	if e.Name == "" || strings.HasPrefix(e.Name, "/") || e.Name == Trailer {
		return fmt.Errorf("cpio: bad name %q", e.Name)
	}
	switch e.Mode & TypeMask {
	case TypeDir, TypeChar:
		if len(e.Data) != 0 {
			return fmt.Errorf("cpio: %s: data on a directory or device", e.Name)
		}
	case TypeReg, TypeLink:
	default:
		return fmt.Errorf("cpio: %s: unsupported mode %o", e.Name, e.Mode)
	}
	w.ino++
	nlink := uint32(1)
	if e.Mode&TypeMask == TypeDir {
		nlink = 2
	}
	return w.write(w.ino, e.Mode, nlink, e.Major, e.Minor, e.Name, e.Data)
}

// Close writes the trailer. It does not close the underlying writer.
func (w *Writer) Close() error {
	if w.closed {
		return nil
	}
	w.closed = true
	return w.write(0, 0, 1, 0, 0, Trailer, nil)
}

func (w *Writer) write(ino, mode, nlink, major, minor uint32, name string, data []byte) error {
	if len(data) > 0xFFFFFFFF {
		return fmt.Errorf("cpio: %s: too large", name)
	}
	hdr := fmt.Sprintf("%s%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		magic, ino, mode, 0, 0, nlink, 0, len(data), 0, 0, major, minor, len(name)+1, 0)
	buf := make([]byte, 0, len(hdr)+len(name)+4)
	buf = append(buf, hdr...)
	buf = append(buf, name...)
	buf = append(buf, 0)
	buf = append(buf, make([]byte, pad(len(buf)))...) // header+name padded to 4
	if err := w.put(buf); err != nil {
		return err
	}
	if err := w.put(data); err != nil {
		return err
	}
	return w.put(make([]byte, pad(len(data))))
}

func (w *Writer) put(b []byte) error {
	_, err := w.w.Write(b)
	return err
}

func pad(n int) int { return (4 - n%4) % 4 }
