// Package consolelog keeps a VM's serial console file within a size. QEMU
// appends to console.log (a file chardev with append=on, so every write goes
// to the end of the file, whoever cut it); Rotate moves the file's tail to
// console.log.1 and empties it once it holds half the cap, so the two
// together stay under the cap and always hold the latest output. Readers
// take the tail across both (logtail.Lines reads its Predecessor, console.log.1, first).
package consolelog

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/logtail"
)

// Result is what one Rotate did.
type Result struct {
	// Rotated says the file was rotated.
	Rotated bool
	// Moved is what the file held, now gone from it; Kept the part of it
	// now in the .1 file; Dropped the console output no longer on disk (the
	// .1 file it replaced, the head of the file beyond half the cap).
	Moved, Kept, Dropped int64
}

// lineSearch bounds how far into the kept tail Rotate looks for the start
// of a line.
const lineSearch = 64 << 10

// Rotate rotates path once it holds capBytes/2 or more: its last
// capBytes/2 bytes, from the first line that starts there, replace the .1
// file, and path is emptied. Output the guest writes meanwhile goes along
// with the tail, except what arrives between the last read and the
// truncate (microseconds). The writer must have the file open with
// O_APPEND (AppendOnly), or it would go on writing at its old offset.
func Rotate(path string, capBytes int64) (Result, error) {
	half := capBytes / 2
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return Result{}, nil
	}
	if err != nil {
		return Result{}, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || fi.Size() < half {
		return Result{}, err
	}
	size := fi.Size()
	start := size - half
	if start > 0 {
		// The window's first line is most likely cut: keep from the next.
		head := make([]byte, min(lineSearch, half))
		n, _ := f.ReadAt(head, start)
		if i := bytes.IndexByte(head[:n], '\n'); i >= 0 {
			start += int64(i) + 1
		}
	}
	var old int64
	if fi, err := os.Stat(logtail.Predecessor(path)); err == nil {
		old = fi.Size()
	}
	tmp := logtail.Predecessor(path) + ".tmp"
	out, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return Result{}, err
	}
	kept, err := io.Copy(out, io.NewSectionReader(f, start, size-start))
	// Whatever was appended while copying goes along (a few rounds at most:
	// a guest cannot outwrite a local file copy for long).
	end := size
	for range 4 {
		fi, serr := f.Stat()
		if err != nil || serr != nil || fi.Size() <= end {
			break
		}
		var n int64
		n, err = io.Copy(out, io.NewSectionReader(f, end, fi.Size()-end))
		kept += n
		end = fi.Size()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, logtail.Predecessor(path))
	}
	if err != nil {
		_ = os.Remove(tmp)
		return Result{}, err
	}
	if err := f.Truncate(0); err != nil {
		return Result{}, err
	}
	return Result{Rotated: true, Moved: end, Kept: kept, Dropped: old + start}, nil
}

// Size is what path and its .1 file hold together.
func Size(path string) int64 {
	var total int64
	for _, p := range []string{path, logtail.Predecessor(path)} {
		if fi, err := os.Stat(p); err == nil {
			total += fi.Size()
		}
	}
	return total
}

// AppendOnly says whether every descriptor process pid holds on path was
// opened with O_APPEND (true when it holds none). A QEMU started before its
// console was an append=on chardev writes at its own offset, so cutting
// its file would leave a hole as large as what was cut.
func AppendOnly(pid int, path string) (bool, error) {
	want, err := os.Stat(path)
	if err != nil {
		return false, err
	}
	fdDir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	fds, err := os.ReadDir(fdDir)
	if err != nil {
		return false, err
	}
	for _, fd := range fds {
		fi, err := os.Stat(filepath.Join(fdDir, fd.Name()))
		if err != nil || !os.SameFile(fi, want) {
			continue // closed meanwhile, or another file
		}
		flags, err := fdFlags(pid, fd.Name())
		if err != nil {
			return false, err
		}
		if flags&syscall.O_APPEND == 0 {
			return false, nil
		}
	}
	return true, nil
}

// fdFlags reads the open flags of a descriptor from /proc/<pid>/fdinfo.
func fdFlags(pid int, fd string) (int, error) {
	f, err := os.Open(filepath.Join("/proc", strconv.Itoa(pid), "fdinfo", fd))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "flags:"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 8, 64)
			return int(n), err
		}
	}
	return 0, fmt.Errorf("fdinfo of %d/%s has no flags", pid, fd)
}
