package ociboot

import (
	"bytes"
	"strings"
	"testing"
)

func TestCmdlineRoundTrip(t *testing.T) {
	r := Root{RootHash: bytes.Repeat([]byte{0xab}, 32), Salt: []byte{1, 2, 3}, DataBlocks: 8192}
	got, ok, err := ParseCmdline("console=ttyS0 panic=-1 " + r.Cmdline() + " quiet")
	if !ok || err != nil || !bytes.Equal(got.RootHash, r.RootHash) || !bytes.Equal(got.Salt, r.Salt) || got.DataBlocks != r.DataBlocks {
		t.Fatalf("round trip: %+v %v %v", got, ok, err)
	}
	if want := "verity 1 /dev/vdb /dev/vdc 4096 4096 8192 1 sha256 " + strings.Repeat("ab", 32) + " 010203"; r.Table("/dev/vdb", "/dev/vdc") != want {
		t.Errorf("table %q, want %q", r.Table("/dev/vdb", "/dev/vdc"), want)
	}
	if r.Sectors() != 8192*8 {
		t.Errorf("sectors %d", r.Sectors())
	}
}

// A command line naming no root is no OCI boot; one naming part of a root,
// or a malformed one, is an error: the guest must not boot something else.
func TestParseCmdlineRefuses(t *testing.T) {
	if _, ok, err := ParseCmdline("console=ttyS0 root=/dev/vda"); ok || err != nil {
		t.Errorf("no root: ok %v err %v", ok, err)
	}
	hash := strings.Repeat("ab", 32)
	for _, bad := range []string{
		KeyRootHash + "=" + hash,
		KeyRootHash + "=" + hash + " " + KeySalt + "=00",
		KeyRootHash + "=abcd " + KeySalt + "=00 " + KeyDataBlocks + "=1",
		KeyRootHash + "=" + hash + " " + KeySalt + "=zz " + KeyDataBlocks + "=1",
		KeyRootHash + "=" + hash + " " + KeySalt + "=00 " + KeyDataBlocks + "=0",
		KeyRootHash + "=" + hash + " " + KeySalt + "=00 " + KeyDataBlocks + "=1 " + KeyDataBlocks + "=2",
	} {
		if _, ok, err := ParseCmdline(bad); !ok || err == nil {
			t.Errorf("%q: ok %v err %v, want a refusal", bad, ok, err)
		}
	}
}
