package smbios

import (
	"os"
	"path/filepath"
	"testing"
)

// oemStructure builds a type 11 structure the way firmware lays it out.
func oemStructure(handle uint16, strs ...string) []byte {
	b := []byte{TypeOEMStrings, 5, byte(handle), byte(handle >> 8), byte(len(strs))}
	for _, s := range strs {
		b = append(b, s...)
		b = append(b, 0)
	}
	if len(strs) == 0 {
		b = append(b, 0)
	}
	return append(b, 0)
}

func TestParse(t *testing.T) {
	raw := oemStructure(0x1234, "io.systemd.credential:firstboot.hostname=t1", "vendor thing")
	s, err := Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	if s.Type != 11 || s.Handle != 0x1234 || len(s.Formatted) != 1 || s.Formatted[0] != 2 {
		t.Fatalf("header: %+v", s)
	}
	if len(s.Strings) != 2 || s.Strings[1] != "vendor thing" {
		t.Fatalf("strings: %q", s.Strings)
	}
}

func TestParseNoStrings(t *testing.T) {
	s, err := Parse(oemStructure(1))
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Strings) != 0 {
		t.Fatalf("strings: %q", s.Strings)
	}
}

func TestParseErrors(t *testing.T) {
	for name, raw := range map[string][]byte{
		"short header":   {11, 5},
		"bad length":     {11, 3, 0, 0, 0, 0},
		"truncated":      {11, 9, 0, 0, 1},
		"no terminator":  {11, 5, 0, 0, 1, 'a', 'b'},
		"no second zero": {11, 5, 0, 0, 1, 'a', 0, 'b'},
	} {
		if _, err := Parse(raw); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestOEMStringsCount(t *testing.T) {
	raw := oemStructure(0, "a", "b")
	raw[4] = 3 // claims more strings than present
	s, err := Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := OEMStrings(s); err == nil {
		t.Fatal("count mismatch accepted")
	}
}

func TestParseCredential(t *testing.T) {
	cases := []struct {
		in      string
		name    string
		value   string
		ok, err bool
	}{
		{"io.systemd.credential:firstboot.hostname=t1", "firstboot.hostname", "t1", true, false},
		{"io.systemd.credential:a=b=c", "a", "b=c", true, false},
		{"io.systemd.credential:empty=", "empty", "", true, false},
		{"io.systemd.credential.binary:k=aGVsbG8K", "k", "hello\n", true, false},
		{"io.systemd.credential.binary:k=!!", "", "", true, true},
		{"io.systemd.credential:noequals", "", "", true, true},
		{"io.systemd.credential:=x", "", "", true, true},
		{"io.systemd.credential:a/b=x", "", "", true, true},
		{"io.systemd.stub.kernel-cmdline-extra=ignition.firstboot", "", "", false, false},
	}
	for _, c := range cases {
		name, val, ok, err := ParseCredential(c.in)
		if ok != c.ok || (err != nil) != c.err || name != c.name || string(val) != c.value {
			t.Errorf("%q: got %q %q %v %v", c.in, name, val, ok, err)
		}
	}
}

func TestReadCredentials(t *testing.T) {
	dir := t.TempDir()
	write := func(entry string, raw []byte) {
		if err := os.MkdirAll(filepath.Join(dir, entry), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, entry, "raw"), raw, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("1-0", []byte{1, 4, 0, 0, 0, 0}) // not type 11: ignored
	write("11-0", oemStructure(0x1100,
		"io.systemd.credential:firstboot.hostname=t1",
		"io.systemd.credential:vmm.notify_socket=vsock-stream:2:1234",
		"io.systemd.credential:bad",
	))
	write("11-1", oemStructure(0x1101,
		"io.systemd.credential.binary:ssh.authorized_keys.root=c3NoLWVkMjU1MTkgQUFBQQo=",
		"io.systemd.credential:firstboot.hostname=t2",
	))
	creds, errs := ReadCredentials(dir)
	if len(errs) != 1 {
		t.Fatalf("errors: %v", errs)
	}
	want := map[string]string{
		"firstboot.hostname":       "t2",
		"vmm.notify_socket":        "vsock-stream:2:1234",
		"ssh.authorized_keys.root": "ssh-ed25519 AAAA\n",
	}
	if len(creds) != len(want) {
		t.Fatalf("creds: %q", creds)
	}
	for k, v := range want {
		if string(creds[k]) != v {
			t.Errorf("%s = %q, want %q", k, creds[k], v)
		}
	}
	if creds, errs := ReadCredentials(filepath.Join(dir, "missing")); len(creds) != 0 || len(errs) != 0 {
		t.Fatalf("missing dir: %v %v", creds, errs)
	}
}
