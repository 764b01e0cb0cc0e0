package qemu

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestKVMProbeKey: the cache key follows the boot, the binary and the
// firmware files; the probe itself (QEMU) is covered by the integration test.
func TestKVMProbeKey(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	boot := write("boot_id", "aaaa\n")
	old := bootIDPath
	bootIDPath = boot
	t.Cleanup(func() { bootIDPath = old })
	bin, code, vars := write("qemu", "q"), write("code.fd", "c"), write("vars.fd", "v")

	k1, err := kvmProbeKey(bin, code, vars)
	if err != nil {
		t.Fatal(err)
	}
	if k2, _ := kvmProbeKey(bin, code, vars); k2 != k1 {
		t.Fatal("the key is not stable")
	}
	write("boot_id", "bbbb\n")
	if k, _ := kvmProbeKey(bin, code, vars); k == k1 {
		t.Error("a new boot keeps the key")
	}
	write("boot_id", "aaaa\n")
	later := time.Now().Add(time.Hour)
	os.Chtimes(code, later, later)
	if k, _ := kvmProbeKey(bin, code, vars); k == k1 {
		t.Error("new firmware keeps the key")
	}
	if _, err := kvmProbeKey(filepath.Join(dir, "missing"), code, vars); err == nil {
		t.Error("a missing binary gives a key")
	}
}

// TestProbeKVMCachedHit: a record with the current key answers without
// running QEMU (the binary here does not exist as a QEMU).
func TestProbeKVMCachedHit(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "qemu")
	code := filepath.Join(dir, "code.fd")
	vars := filepath.Join(dir, "vars.fd")
	for _, p := range []string{bin, code, vars} {
		os.WriteFile(p, []byte("x"), 0o600)
	}
	key, err := kvmProbeKey(bin, code, vars)
	if err != nil {
		t.Skipf("no boot id here: %v", err)
	}
	cache := filepath.Join(dir, "kvm-probe.json")
	os.WriteFile(cache, []byte(`{"key":"`+key+`","error":"firmware said nothing"}`), 0o600)
	cpu, cached, perr := ProbeKVMCached(context.Background(), cache, bin, code, vars)
	if !cached || cpu != "" || perr == nil || perr.Error() != "firmware said nothing" {
		t.Fatalf("cached answer: %q %v %v", cpu, perr, cached)
	}
	os.WriteFile(cache, []byte(`{"key":"`+key+`","cpu":"host"}`), 0o600)
	if cpu, cached, perr := ProbeKVMCached(context.Background(), cache, bin, code, vars); !cached || cpu != "host" || perr != nil {
		t.Fatalf("cached answer: %q %v %v", cpu, perr, cached)
	}
}
