package ocirun

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/giantswarm/vm-manager/pkg/ociboot"
)

// The offsets of struct dm_ioctl and struct dm_target_spec in
// include/uapi/linux/dm-ioctl.h on x86-64, written out: the encoding must
// match the kernel's, not only x/sys's idea of it.
func TestDMStructLayout(t *testing.T) {
	var h unix.DmIoctl
	var s unix.DmTargetSpec
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof(dm_ioctl)", unsafe.Sizeof(h), 312},
		{"version", unsafe.Offsetof(h.Version), 0},
		{"data_size", unsafe.Offsetof(h.Data_size), 12},
		{"data_start", unsafe.Offsetof(h.Data_start), 16},
		{"target_count", unsafe.Offsetof(h.Target_count), 20},
		{"open_count", unsafe.Offsetof(h.Open_count), 24},
		{"flags", unsafe.Offsetof(h.Flags), 28},
		{"event_nr", unsafe.Offsetof(h.Event_nr), 32},
		{"dev", unsafe.Offsetof(h.Dev), 40},
		{"name", unsafe.Offsetof(h.Name), 48},
		{"uuid", unsafe.Offsetof(h.Uuid), 176},
		{"data", unsafe.Offsetof(h.Data), 305},
		{"sizeof(dm_target_spec)", unsafe.Sizeof(s), 40},
		{"sector_start", unsafe.Offsetof(s.Sector_start), 0},
		{"length", unsafe.Offsetof(s.Length), 8},
		{"status", unsafe.Offsetof(s.Status), 16},
		{"next", unsafe.Offsetof(s.Next), 20},
		{"target_type", unsafe.Offsetof(s.Target_type), 24},
	} {
		if c.got != c.want {
			t.Errorf("%s: %d, want %d", c.name, c.got, c.want)
		}
	}
	// _IOWR(0xfd, nr, struct dm_ioctl)
	for _, c := range []struct {
		name string
		req  uint
		nr   uint
	}{{"DM_DEV_CREATE", unix.DM_DEV_CREATE, 3}, {"DM_DEV_REMOVE", unix.DM_DEV_REMOVE, 4}, {"DM_DEV_SUSPEND", unix.DM_DEV_SUSPEND, 6}, {"DM_TABLE_LOAD", unix.DM_TABLE_LOAD, 9}} {
		if want := uint(3<<30|312<<16|0xfd<<8) | c.nr; c.req != want {
			t.Errorf("%s = %#x, want %#x", c.name, c.req, want)
		}
	}
}

func TestEncodeDMTableLoad(t *testing.T) {
	r := ociboot.Root{RootHash: bytes.Repeat([]byte{0xab}, 32), Salt: []byte{1, 2}, DataBlocks: 10}
	typ, params := splitTable(r.Table("254:0", "254:16"))
	if typ != "verity" || !strings.HasPrefix(params, "1 254:0 254:16 4096 4096 10 1 sha256 abab") || !strings.HasSuffix(params, " 0102") {
		t.Fatalf("table %q %q", typ, params)
	}
	b, err := encodeDM("oci-root", unix.DM_READONLY_FLAG, []dmTarget{{Length: r.Sectors(), Type: typ, Params: params}})
	if err != nil {
		t.Fatal(err)
	}
	le := binary.LittleEndian
	if len(b)%8 != 0 || le.Uint32(b[12:]) != uint32(len(b)) {
		t.Errorf("data_size %d, buffer %d bytes", le.Uint32(b[12:]), len(b))
	}
	if le.Uint32(b[0:]) != 4 || le.Uint32(b[16:]) != 312 || le.Uint32(b[20:]) != 1 || le.Uint32(b[28:]) != unix.DM_READONLY_FLAG {
		t.Errorf("header: version %d data_start %d target_count %d flags %#x", le.Uint32(b[0:]), le.Uint32(b[16:]), le.Uint32(b[20:]), le.Uint32(b[28:]))
	}
	if name := string(bytes.TrimRight(b[48:176], "\x00")); name != "oci-root" {
		t.Errorf("name %q", name)
	}
	spec := b[312:]
	if le.Uint64(spec[0:]) != 0 || le.Uint64(spec[8:]) != 80 {
		t.Errorf("sector_start %d length %d, want 0 80", le.Uint64(spec[0:]), le.Uint64(spec[8:]))
	}
	if next := le.Uint32(spec[20:]); int(next) != len(spec) || next%8 != 0 {
		t.Errorf("next %d, spec and params take %d", next, len(spec))
	}
	if tt := string(bytes.TrimRight(spec[24:40], "\x00")); tt != "verity" {
		t.Errorf("target_type %q", tt)
	}
	p := spec[40:]
	if i := bytes.IndexByte(p, 0); i < 0 || string(p[:i]) != params {
		t.Errorf("params %q", p)
	}
}

func TestEncodeDMRefusesBadNames(t *testing.T) {
	for _, name := range []string{"", "a/b", strings.Repeat("x", 128)} {
		if _, err := encodeDM(name, 0, nil); err == nil {
			t.Errorf("name %q accepted", name)
		}
	}
	if _, err := encodeDM("x", 0, []dmTarget{{Type: strings.Repeat("t", 16)}}); err == nil {
		t.Error("16-byte target type accepted")
	}
	b, err := encodeDM("oci-root", 0, nil)
	if err != nil || len(b) != 312 || binary.LittleEndian.Uint32(b[12:]) != 312 {
		t.Errorf("header only: %d bytes, %v", len(b), err)
	}
}
