package guestimage

import (
	"os"
	"path/filepath"
	"testing"
)

// replaceContents is the fallback for an image directory that cannot be
// renamed (a mount point).
func TestReplaceContents(t *testing.T) {
	stage, dir := t.TempDir(), t.TempDir()
	writeTree(t, dir, map[string]string{"old": "1", "sub/old": "2"})
	want := map[string]string{"new": "3", "sysupdate/k/x": "4", MarkerFile: "{}"}
	writeTree(t, stage, want)
	if err := replaceContents(stage, dir); err != nil {
		t.Fatal(err)
	}
	sameTree(t, "replaced", readTree(t, dir), want)
	// Across file systems, move copies.
	src := filepath.Join(t.TempDir(), "d")
	writeTree(t, src, map[string]string{"f": "5", "g/h": "6"})
	dst := filepath.Join(t.TempDir(), "d")
	if err := CopyFile(filepath.Join(src, "f"), dst+".f", 0o644); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(dst + ".f"); string(b) != "5" {
		t.Errorf("copyFile: %q", b)
	}
}
