// Package logtail reads the end of a VM's log files (the serial console,
// qemu.log) for the API and for error messages.
package logtail

import (
	"bytes"
	"os"
)

// maxRead bounds what one call reads of huge files.
const maxRead = 4 << 20

// Predecessor is where a log file's earlier part is kept once it has been
// rotated (the serial console's, internal/consolelog).
func Predecessor(path string) string { return path + ".1" }

// Lines returns the last n lines of a file, "" when it is missing or empty.
// When the file has fewer, they are taken from its Predecessor first (the
// two are one stream). The serial console ends lines in CRLF: the CRs go.
func Lines(path string, n int) string {
	buf := tail(path, maxRead)
	if bytes.Count(buf, []byte("\n")) <= n && len(buf) < maxRead {
		if prev := tail(Predecessor(path), maxRead-len(buf)); len(prev) > 0 {
			buf = append(prev, buf...)
		}
	}
	buf = bytes.TrimRight(buf, "\n")
	if len(buf) == 0 {
		return ""
	}
	lines := bytes.Split(buf, []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	for i, l := range lines {
		lines[i] = bytes.TrimSuffix(l, []byte("\r"))
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// tail is the last limit bytes of a file at most; nil when it cannot be read.
func tail(path string, limit int) []byte {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil
	}
	off := max(fi.Size()-int64(limit), 0)
	buf := make([]byte, fi.Size()-off)
	n, _ := f.ReadAt(buf, off) // a file cut meanwhile reads short
	return buf[:n]
}

// WithHeader is Lines behind a header, or "" when there are none.
func WithHeader(path string, n int, header string) string {
	if t := Lines(path, n); t != "" {
		return header + t
	}
	return ""
}
