package ignition

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestDecodeDataURL(t *testing.T) {
	for _, tc := range []struct {
		in, want, err string
	}{
		{in: "data:,", want: ""},
		{in: "data:,hello%20world%0A", want: "hello world\n"},
		{in: "data:,a+b", want: "a+b"}, // '+' is not a space in a data URL
		{in: "data:,100%25", want: "100%"},
		{in: "data:text/plain;charset=utf-8,x%3Dy", want: "x=y"},
		{in: "data:;base64,aGVsbG8gd29ybGQK", want: "hello world\n"},
		{in: "data:text/plain;base64,aGk=", want: "hi"},
		{in: "data:;base64,aGk", want: "hi"},              // unpadded
		{in: "data:;BASE64,aGk=", want: "hi"},             // case-insensitive
		{in: "data:;base64,aG%20k=", want: "hi"},          // whitespace ignored
		{in: "data:;base64,%2B%2F8%3D", want: "\xfb\xff"}, // percent-encoded base64
		{in: "data:;base64,+/8=", want: "\xfb\xff"},
		{in: "data:;base64,!!!", err: "base64"},
		{in: "data:no-comma", err: "without a comma"},
		{in: "data:,%zz", err: "invalid URL escape"},
		{in: "https://example.com/x", err: `scheme "https" not supported`},
		{in: "nonsense", err: "not a URL"},
	} {
		got, err := DecodeDataURL(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: err %v, want %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || string(got) != tc.want {
			t.Errorf("%q: %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

const config = `{
  "ignition": {"version": "3.4.0"},
  "passwd": {"users": [{"name": "core"}]},
  "systemd": {"units": [{"name": "x.service", "enabled": true}]},
  "storage": {
    "directories": [{"path": "/var/x"}],
    "files": [
      {"path": "/etc/hello", "mode": 420, "contents": {"source": "data:,hello%0A"}},
      {"path": "/opt/deep/dir/run.sh", "mode": 493, "contents": {"source": "data:;base64,IyEvYmluL3NoCmVjaG8gaGkK"}},
      {"path": "/etc/empty"},
      {"path": "/etc/secret", "mode": 384, "contents": {"source": "data:,s3cret"}}
    ]
  }
}`

func TestParseAndApply(t *testing.T) {
	c, ignored, err := Parse([]byte(config))
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(ignored, " "); got != "passwd storage.directories systemd" {
		t.Errorf("ignored %q", got)
	}
	root := t.TempDir()
	written, err := Apply(c, root)
	if err != nil {
		t.Fatal(err)
	}
	if len(written) != 4 {
		t.Fatalf("written %+v", written)
	}
	for _, tc := range []struct {
		path, content string
		mode          os.FileMode
	}{
		{"/etc/hello", "hello\n", 0o644},
		{"/opt/deep/dir/run.sh", "#!/bin/sh\necho hi\n", 0o755},
		{"/etc/empty", "", 0o644},
		{"/etc/secret", "s3cret", 0o600},
	} {
		p := filepath.Join(root, tc.path)
		b, err := os.ReadFile(p)
		if err != nil || string(b) != tc.content {
			t.Errorf("%s: %q %v", tc.path, b, err)
		}
		if st, err := os.Stat(p); err != nil || st.Mode().Perm() != tc.mode {
			t.Errorf("%s: mode %v %v, want %v", tc.path, st.Mode().Perm(), err, tc.mode)
		}
	}
	if st, err := os.Stat(filepath.Join(root, "opt/deep/dir")); err != nil || !st.IsDir() {
		t.Errorf("parent directories: %v", err)
	}
	leftovers, _ := filepath.Glob(filepath.Join(root, "etc", "*.vm-agent-tmp"))
	if len(leftovers) > 0 {
		t.Errorf("temporary files left: %v", leftovers)
	}
}

func TestParseRejects(t *testing.T) {
	for _, in := range []string{`not json`, `{"ignition":{"version":"2.2.0"}}`, `{}`} {
		if _, _, err := Parse([]byte(in)); err == nil {
			t.Errorf("%s: accepted", in)
		}
	}
}

func TestApplyRejects(t *testing.T) {
	root := t.TempDir()
	for _, in := range []string{
		`{"ignition":{"version":"3.4.0"},"storage":{"files":[{"path":"relative","contents":{"source":"data:,x"}}]}}`,
		`{"ignition":{"version":"3.4.0"},"storage":{"files":[{"path":"/x","contents":{"source":"https://e/x"}}]}}`,
		`{"ignition":{"version":"3.4.0"},"storage":{"files":[{"path":"/x","contents":{"source":"data:,x","compression":"gzip"}}]}}`,
		`{"ignition":{"version":"3.4.0"},"storage":{"files":[{"path":"/x","mode":99999,"contents":{"source":"data:,x"}}]}}`,
	} {
		c, _, err := Parse([]byte(in))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Apply(c, root); err == nil {
			t.Errorf("%s: applied", in)
		}
	}
	// ".." cannot leave the root.
	c, _, _ := Parse([]byte(`{"ignition":{"version":"3.4.0"},"storage":{"files":[{"path":"/../../escape","contents":{"source":"data:,x"}}]}}`))
	w, err := Apply(c, root)
	if err != nil || w[0].Path != "/escape" {
		t.Fatalf("%+v %v", w, err)
	}
	if _, err := os.Stat(filepath.Join(root, "escape")); err != nil {
		t.Error(err)
	}
}
