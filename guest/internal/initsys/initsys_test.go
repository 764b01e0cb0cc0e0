package initsys

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func event(typ, code uint16, value int32) []byte {
	b := make([]byte, inputEventSize)
	binary.LittleEndian.PutUint64(b, 1700000000) // tv_sec: ignored
	binary.LittleEndian.PutUint16(b[16:], typ)
	binary.LittleEndian.PutUint16(b[18:], code)
	binary.LittleEndian.PutUint32(b[20:], uint32(value))
	return b
}

func TestParseInputEvents(t *testing.T) {
	stream := bytes.Join([][]byte{event(EvKey, KeyPower, 1), event(0, 0, 0), event(EvKey, KeyPower, 0), {1, 2, 3}}, nil)
	evs := ParseInputEvents(stream)
	if len(evs) != 3 {
		t.Fatalf("%d events", len(evs))
	}
	if !IsPowerPress(evs[0]) || IsPowerPress(evs[1]) || IsPowerPress(evs[2]) {
		t.Fatalf("%+v", evs)
	}
	if evs[2].Value != 0 || evs[0].Code != 116 {
		t.Fatalf("%+v", evs)
	}
}

func TestWatchPowerButton(t *testing.T) {
	dir := t.TempDir()
	// A key release and another key, then the power press.
	data := bytes.Join([][]byte{event(EvKey, 30, 1), event(EvKey, KeyPower, 0), event(EvKey, KeyPower, 1)}, nil)
	if err := os.WriteFile(filepath.Join(dir, "event0"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "event1"), event(EvKey, 30, 1), 0o600)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	got := make(chan string, 2)
	go WatchPowerButton(ctx, filepath.Join(dir, "event*"), 10*time.Millisecond, func(dev string) { got <- dev })
	select {
	case dev := <-got:
		if filepath.Base(dev) != "event0" {
			t.Fatalf("pressed on %s", dev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("power press not seen")
	}
}

func TestReadModuleOrder(t *testing.T) {
	p := filepath.Join(t.TempDir(), ModuleOrderFile)
	os.WriteFile(p, []byte("# generated\nvirtio_ring.ko\n\nvirtio.ko\n virtio-rng.ko \n"), 0o644)
	names, err := ReadModuleOrder(p)
	if err != nil || len(names) != 3 || names[2] != "virtio-rng.ko" {
		t.Fatalf("%q %v", names, err)
	}
	os.WriteFile(p, []byte("../evil.ko\n"), 0o644)
	if _, err := ReadModuleOrder(p); err == nil {
		t.Fatal("path accepted")
	}
}

func TestValidHostname(t *testing.T) {
	for _, ok := range []string{"t1", "vm-1.example.com", "A0"} {
		if err := ValidHostname(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "-a", "a-", "a..b", "a_b", "a b", string(make([]byte, 65))} {
		if ValidHostname(bad) == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestNormalizeMachineID(t *testing.T) {
	id, err := NormalizeMachineID("0123456789ABCDEF0123456789abcdef\n")
	if err != nil || id != "0123456789abcdef0123456789abcdef" {
		t.Fatal(id, err)
	}
	id, err = NormalizeMachineID("01234567-89ab-cdef-0123-456789abcdef")
	if err != nil || id != "0123456789abcdef0123456789abcdef" {
		t.Fatal(id, err)
	}
	for _, bad := range []string{"", "xyz", "00000000-0000-0000-0000-000000000000", "0123456789abcdef0123456789abcdeg"} {
		if _, err := NormalizeMachineID(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
