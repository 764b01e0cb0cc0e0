package ocirun

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// DMControl is device-mapper's control node (a misc device devtmpfs names
// mapper/control once dm_mod is loaded).
const DMControl = "/dev/mapper/control"

// dmControlMinor is MAPPER_CTRL_MINOR (misc major 10): the node is made
// when devtmpfs did not.
const dmControlMinor = 236

// dmTarget is one line of a table: its sectors and type, and the target's
// parameters.
type dmTarget struct {
	Start, Length uint64
	Type          string
	Params        string
}

// dmHeader is struct dm_ioctl (include/uapi/linux/dm-ioctl.h); x/sys's
// unix.DmIoctl is generated from the same header, padding fields included,
// so binary.Write gives the kernel's layout byte for byte.
func dmHeader(name string, flags, dataSize, targets uint32) (unix.DmIoctl, error) {
	var h unix.DmIoctl
	if name == "" || len(name) >= len(h.Name) || strings.ContainsRune(name, '/') {
		return h, fmt.Errorf("device-mapper name %q", name)
	}
	h.Version = [3]uint32{unix.DM_VERSION_MAJOR, 0, 0} // any 4.x kernel takes minor 0
	h.Data_size = dataSize
	h.Data_start = unix.SizeofDmIoctl
	h.Target_count = targets
	h.Flags = flags
	copy(h.Name[:], name)
	return h, nil
}

// encodeDM is one ioctl's buffer: the header, then each target's struct
// dm_target_spec followed by its NUL-terminated parameters, each padded to
// 8 bytes (the kernel follows spec->next, an offset from that spec).
func encodeDM(name string, flags uint32, targets []dmTarget) ([]byte, error) {
	var body bytes.Buffer
	for _, t := range targets {
		var tt [16]byte
		if t.Type == "" || len(t.Type) >= len(tt) {
			return nil, fmt.Errorf("device-mapper target type %q", t.Type)
		}
		copy(tt[:], t.Type)
		params := append([]byte(t.Params), 0)
		size := unix.SizeofDmTargetSpec + len(params)
		size = (size + 7) &^ 7
		spec := unix.DmTargetSpec{Sector_start: t.Start, Length: t.Length, Next: uint32(size), Target_type: tt}
		if err := binary.Write(&body, binary.NativeEndian, spec); err != nil {
			return nil, err
		}
		body.Write(params)
		body.Write(make([]byte, size-unix.SizeofDmTargetSpec-len(params)))
	}
	h, err := dmHeader(name, flags, uint32(unix.SizeofDmIoctl+body.Len()), uint32(len(targets)))
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	if err := binary.Write(&b, binary.NativeEndian, h); err != nil {
		return nil, err
	}
	b.Write(body.Bytes())
	return b.Bytes(), nil
}

// dmIoctl runs one request on the control node; the kernel writes its
// answer back into the header.
func dmIoctl(ctl *os.File, req uint, buf []byte) (unix.DmIoctl, error) {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, ctl.Fd(), uintptr(req), uintptr(unsafe.Pointer(&buf[0])))
	var h unix.DmIoctl
	_ = binary.Read(bytes.NewReader(buf), binary.NativeEndian, &h)
	if errno != 0 {
		return h, errno
	}
	return h, nil
}

// openDMControl opens the control node, making it if devtmpfs did not.
func openDMControl(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		_ = os.MkdirAll(filepath.Dir(path), 0o755)
		if e := unix.Mknod(path, unix.S_IFCHR|0o600, int(unix.Mkdev(10, dmControlMinor))); e != nil && !errors.Is(e, unix.EEXIST) {
			return nil, fmt.Errorf("mknod %s: %w", path, e)
		}
		f, err = os.OpenFile(path, os.O_RDWR|unix.O_CLOEXEC, 0)
	}
	return f, err
}

// createReadOnlyDM creates device name with one read-only table (verity
// refuses a writable one) and activates it, as `dmsetup create --readonly`
// does: DM_DEV_CREATE, DM_TABLE_LOAD, DM_DEV_SUSPEND without the suspend
// flag (a resume). It returns the device number; a failure removes the
// device again.
func createReadOnlyDM(control, name string, t dmTarget) (dev uint64, err error) {
	ctl, err := openDMControl(control)
	if err != nil {
		return 0, err
	}
	defer ctl.Close()
	buf, err := encodeDM(name, 0, nil)
	if err != nil {
		return 0, err
	}
	h, err := dmIoctl(ctl, unix.DM_DEV_CREATE, buf)
	if err != nil {
		return 0, fmt.Errorf("DM_DEV_CREATE %s: %w", name, err)
	}
	defer func() {
		if err != nil {
			if b, e := encodeDM(name, 0, nil); e == nil {
				_, _ = dmIoctl(ctl, unix.DM_DEV_REMOVE, b)
			}
		}
	}()
	if buf, err = encodeDM(name, unix.DM_READONLY_FLAG, []dmTarget{t}); err != nil {
		return 0, err
	}
	if _, err = dmIoctl(ctl, unix.DM_TABLE_LOAD, buf); err != nil {
		return 0, fmt.Errorf("DM_TABLE_LOAD %s (%s %s): %w", name, t.Type, t.Params, err)
	}
	if buf, err = encodeDM(name, 0, nil); err != nil {
		return 0, err
	}
	if _, err = dmIoctl(ctl, unix.DM_DEV_SUSPEND, buf); err != nil {
		return 0, fmt.Errorf("DM_DEV_SUSPEND (resume) %s: %w", name, err)
	}
	return h.Dev, nil
}

// splitTable cuts a table line ("verity 1 ...") into type and parameters.
func splitTable(line string) (typ, params string) {
	typ, params, _ = strings.Cut(line, " ")
	return typ, params
}
