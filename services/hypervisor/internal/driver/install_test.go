package driver

import (
	"bytes"
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSameStart(t *testing.T) {
	dir := t.TempDir()
	img := make([]byte, 2*compareChunk+777)
	rand.Read(img)
	img[0] = 0xa5 // an untouched (zero) volume differs at byte 0
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	imgPath := write("img.raw", img)
	longer := append(bytes.Clone(img), bytes.Repeat([]byte{0}, compareChunk)...)
	flipped := bytes.Clone(longer)
	flipped[compareChunk+5] ^= 1
	for name, tc := range map[string]struct {
		vol  []byte
		want string
	}{
		"a copy on a larger volume": {longer, ""},
		"one flipped bit":           {flipped, "differs from the image's disk " + imgPath + " at byte 4194309"},
		"a short volume":            {img[:compareChunk], "the volume ends at byte 4194304"},
		"an untouched volume":       {make([]byte, len(longer)), "at byte 0"},
	} {
		err := sameStart(imgPath, write(strings.ReplaceAll(name, " ", "-"), tc.vol))
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: err %v, want %q", name, err, tc.want)
		}
	}
}
