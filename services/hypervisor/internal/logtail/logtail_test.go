package logtail

import (
	"os"
	"strings"
	"testing"
)

func TestLines(t *testing.T) {
	p := t.TempDir() + "/console.log"
	if got := Lines(p, 3); got != "" {
		t.Errorf("missing file: %q", got)
	}
	var b strings.Builder
	for i := 1; i <= 10; i++ {
		b.WriteString(strings.Repeat("x", i) + "\r\n")
	}
	if err := os.WriteFile(p, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := Lines(p, 3); got != "xxxxxxxx\nxxxxxxxxx\nxxxxxxxxxx" {
		t.Errorf("Lines 3: %q", got)
	}
	if got := WithHeader(p, 1, "\nconsole:\n"); got != "\nconsole:\nxxxxxxxxxx" {
		t.Errorf("WithHeader: %q", got)
	}
}

// A rotated file's lines continue in it: the tail spans both files, and a
// line cut by the rotation is whole again.
func TestLinesAcrossPredecessor(t *testing.T) {
	p := t.TempDir() + "/console.log"
	if err := os.WriteFile(Predecessor(p), []byte("one\r\ntwo\r\nthr"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := Lines(p, 2); got != "two\nthr" {
		t.Errorf("only the predecessor: %q", got)
	}
	if err := os.WriteFile(p, []byte("ee\r\nfour\r\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for n, want := range map[int]string{1: "four", 2: "three\nfour", 4: "one\ntwo\nthree\nfour", 10: "one\ntwo\nthree\nfour"} {
		if got := Lines(p, n); got != want {
			t.Errorf("Lines %d: %q, want %q", n, got, want)
		}
	}
}
