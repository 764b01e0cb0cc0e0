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
