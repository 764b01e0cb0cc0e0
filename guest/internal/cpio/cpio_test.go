package cpio

import (
	"bytes"
	"testing"
)

func TestEntryLayout(t *testing.T) {
	var b bytes.Buffer
	w := NewWriter(&b)
	if err := w.WriteEntry(File("a", 0o644, []byte("xy"))); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	// 110-byte header + "a\0" = 112 (aligned), data 2 + 2 padding, then the trailer.
	out := b.Bytes()
	if string(out[:6]) != "070701" || string(out[110:112]) != "a\x00" || string(out[112:116]) != "xy\x00\x00" {
		t.Fatalf("%q", out[:116])
	}
	if string(out[116:122]) != "070701" || !bytes.Contains(out[116:], []byte(Trailer+"\x00")) || len(out)%4 != 0 {
		t.Fatalf("trailer: %q", out[116:])
	}
}

func TestWriteEntryRejects(t *testing.T) {
	w := NewWriter(&bytes.Buffer{})
	for _, e := range []Entry{
		{Name: "", Mode: TypeReg},
		{Name: "/abs", Mode: TypeReg},
		{Name: Trailer, Mode: TypeReg},
		{Name: "d", Mode: TypeDir, Data: []byte("x")},
		{Name: "fifo", Mode: 0o010644},
	} {
		if err := w.WriteEntry(e); err == nil {
			t.Errorf("%+v accepted", e)
		}
	}
	w.Close()
	if err := w.WriteEntry(Dir("late", 0o755)); err == nil {
		t.Error("write after close accepted")
	}
}
