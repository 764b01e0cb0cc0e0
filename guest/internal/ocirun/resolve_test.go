package ocirun

import (
	"os"
	"path/filepath"
	"testing"
)

func TestResolveInStaysInside(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"usr/bin", "etc", "real"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	links := map[string]string{
		"bin":        "usr/bin",
		"escape":     "/",
		"up":         "../../../..",
		"etc/abs":    "/real",
		"loop":       "loop",
		"usr/bin/sh": "busybox",
	}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(root, name)); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct{ in, want string }{
		{"/bin/sh", "usr/bin/busybox"},
		{"/escape/etc/passwd", "etc/passwd"},
		{"/up/proc", "proc"},
		{"/../../proc", "proc"},
		{"/etc/abs/x", "real/x"},
		{"/missing/../etc", "etc"},
		{"/", ""},
	} {
		got, err := ResolveIn(root, c.in)
		if err != nil || got != filepath.Join(root, c.want) {
			t.Errorf("ResolveIn(%q) = %q, %v; want %q", c.in, got, err, filepath.Join(root, c.want))
		}
	}
	if _, err := ResolveIn(root, "/loop/x"); err == nil {
		t.Error("a symlink loop resolved")
	}
}

func TestLookPath(t *testing.T) {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "usr/bin"), 0o755)
	os.MkdirAll(filepath.Join(root, "app"), 0o755)
	os.WriteFile(filepath.Join(root, "usr/bin/python3"), []byte("x"), 0o755)
	os.WriteFile(filepath.Join(root, "usr/bin/data"), []byte("x"), 0o644)
	os.WriteFile(filepath.Join(root, "app/run"), []byte("x"), 0o755)
	os.Symlink("/usr/bin", filepath.Join(root, "bin"))
	for _, c := range []struct{ name, path, dir, want string }{
		{"python3", "/bin:/usr/bin", "/", "/bin/python3"},
		{"python3", "/sbin:/usr/bin", "/", "/usr/bin/python3"},
		{"/usr/bin/python3", "", "/", "/usr/bin/python3"},
		{"./run", DefaultPath, "/app", "./run"},
	} {
		got, err := lookPath(root, c.name, c.path, c.dir)
		if err != nil || got != c.want {
			t.Errorf("lookPath(%q, %q) = %q, %v; want %q", c.name, c.path, got, err, c.want)
		}
	}
	for _, name := range []string{"data", "nothere", "/usr/bin", ""} {
		if got, err := lookPath(root, name, "/usr/bin", "/"); err == nil {
			t.Errorf("lookPath(%q) = %q, want an error", name, got)
		}
	}
}
