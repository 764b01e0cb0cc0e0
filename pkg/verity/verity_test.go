package verity

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// veritysetup is cryptsetup's tool: the reference (hack/install-deps.sh
// installs it; on CI its absence is a failure).
func veritysetup(t *testing.T) string {
	t.Helper()
	for _, p := range []string{"veritysetup", "/usr/sbin/veritysetup", "/sbin/veritysetup"} {
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("veritysetup is missing (cryptsetup-bin; make deps installs it)")
	}
	t.Skip("veritysetup is missing (cryptsetup-bin): nothing to hold the hash device against")
	return ""
}

// The hash device and the root hash are veritysetup format's, byte for byte,
// for one block, one full hash block, one more, several, and three levels.
func TestFormatMatchesVeritysetup(t *testing.T) {
	tool := veritysetup(t)
	p := Params{Salt: []byte("0123456789abcdef0123456789abcdef")}
	copy(p.UUID[:], []byte{0x12, 0x34, 0x56, 0x78, 0x12, 0x34, 0x12, 0x34, 0x12, 0x34, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc})
	for _, blocks := range []int{1, 128, 129, 300, 128*128 + 1} {
		dir := t.TempDir()
		data := make([]byte, blocks*BlockSize)
		rand.Read(data)
		dataPath, hashPath := filepath.Join(dir, "data"), filepath.Join(dir, "hash")
		if err := os.WriteFile(dataPath, data, 0o600); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(tool, "format", "--salt="+hex.EncodeToString(p.Salt), "--uuid=12345678-1234-1234-1234-123456789abc",
			dataPath, hashPath).CombinedOutput()
		if err != nil {
			t.Fatalf("veritysetup: %v: %s", err, out)
		}
		var want string
		for _, l := range strings.Split(string(out), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "Root hash" {
				want = strings.TrimSpace(v)
			}
		}
		wantHash, err := os.ReadFile(hashPath)
		if err != nil {
			t.Fatal(err)
		}
		var got bytes.Buffer
		root, err := Format(bytes.NewReader(data), int64(len(data)), &got, p)
		if err != nil {
			t.Fatal(err)
		}
		if hex.EncodeToString(root) != want || want == "" {
			t.Errorf("%d blocks: root hash %x, veritysetup's %s", blocks, root, want)
		}
		if !bytes.Equal(got.Bytes(), wantHash) {
			t.Errorf("%d blocks: hash device of %d bytes differs from veritysetup's %d", blocks, got.Len(), len(wantHash))
		}
	}
}

// One byte changed in the data is another root hash.
func TestFormatNamesTheContent(t *testing.T) {
	data := make([]byte, 3*BlockSize)
	a, _ := Format(bytes.NewReader(data), int64(len(data)), &bytes.Buffer{}, Params{})
	data[2*BlockSize+7] = 1
	b, _ := Format(bytes.NewReader(data), int64(len(data)), &bytes.Buffer{}, Params{})
	if bytes.Equal(a, b) {
		t.Fatal("a changed byte kept the root hash")
	}
	if _, err := Format(bytes.NewReader(data), 100, &bytes.Buffer{}, Params{}); err == nil {
		t.Fatal("a size that is no multiple of the block size was taken")
	}
}
