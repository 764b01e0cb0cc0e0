// Package logtail reads the end of a VM's log files (the serial console,
// qemu.log) for the API and for error messages.
package logtail

import (
	"bytes"
	"errors"
	"os"
)

// maxRead bounds what one call reads of a huge file.
const maxRead = 4 << 20

// Lines returns the last n lines of a file, "" when it is missing or empty.
// The serial console ends lines in CRLF: the CRs go.
func Lines(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(fi.Size()-maxRead, 0)
	buf := make([]byte, fi.Size()-off)
	if _, err := f.ReadAt(buf, off); err != nil && !errors.Is(err, os.ErrClosed) && len(buf) == 0 {
		return ""
	}
	buf = bytes.TrimRight(buf, "\n")
	lines := bytes.Split(buf, []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	for i, l := range lines {
		lines[i] = bytes.TrimSuffix(l, []byte("\r"))
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// WithHeader is Lines behind a header, or "" when there are none.
func WithHeader(path string, n int, header string) string {
	if t := Lines(path, n); t != "" {
		return header + t
	}
	return ""
}
