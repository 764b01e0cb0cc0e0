package ocirun

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/ociboot"
)

const testPasswd = `root:x:0:0:root:/root:/bin/sh
# a comment
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
app:x:1000:1001:App:/home/app:/bin/sh
broken:x:nope:1::/:
nohome:x:1002:1002:::/bin/sh
`

const testGroup = `root:x:0:
app:x:1001:
staff:x:50:app,daemon
audio:x:29:app
wheel:x:10:daemon
`

func TestResolveUser(t *testing.T) {
	for _, c := range []struct {
		spec string
		want User
	}{
		{"", User{UID: 0, GID: 0, Home: "/root"}},
		{"root", User{UID: 0, GID: 0, Home: "/root"}},
		{"app", User{UID: 1000, GID: 1001, Groups: []uint32{50, 29}, Home: "/home/app"}},
		{"1000", User{UID: 1000, GID: 1001, Groups: []uint32{50, 29}, Home: "/home/app"}},
		{"1000:50", User{UID: 1000, GID: 50, Groups: []uint32{29}, Home: "/home/app"}},
		{"app:audio", User{UID: 1000, GID: 29, Groups: []uint32{50}, Home: "/home/app"}},
		{"daemon:5", User{UID: 1, GID: 5, Groups: []uint32{50, 10}, Home: "/usr/sbin"}},
		{"4242", User{UID: 4242, GID: 0, Home: "/"}},
		{"4242:4243", User{UID: 4242, GID: 4243, Home: "/"}},
		{"nohome", User{UID: 1002, GID: 1002, Home: "/"}},
	} {
		got, err := ResolveUser(c.spec, []byte(testPasswd), []byte(testGroup))
		if err != nil || !reflect.DeepEqual(got, c.want) {
			t.Errorf("ResolveUser(%q) = %+v, %v; want %+v", c.spec, got, err, c.want)
		}
	}
	for _, spec := range []string{"nobody", "app:nogroup", "broken", ":1", "app:"} {
		if got, err := ResolveUser(spec, []byte(testPasswd), []byte(testGroup)); err == nil {
			t.Errorf("ResolveUser(%q) = %+v, want an error", spec, got)
		}
	}
	// An image without the files: numbers work, names do not.
	if u, err := ResolveUser("7:8", nil, nil); err != nil || u.UID != 7 || u.GID != 8 || u.Home != "/" {
		t.Errorf("7:8 without files: %+v, %v", u, err)
	}
	if _, err := ResolveUser("root", nil, nil); err == nil {
		t.Error("a name resolved without /etc/passwd")
	}
}

func TestNewIdentity(t *testing.T) {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/passwd"), []byte(testPasswd), 0o644)
	os.WriteFile(filepath.Join(root, "etc/group"), []byte(testGroup), 0o644)
	id, err := NewIdentity(root, ociboot.Config{User: "app", WorkingDir: "srv", Env: []string{"FOO=bar", "junk", "PATH=/opt/bin"}})
	if err != nil {
		t.Fatal(err)
	}
	want := Identity{Env: []string{"FOO=bar", "PATH=/opt/bin", "HOME=/home/app"}, Dir: "/srv",
		User: User{UID: 1000, GID: 1001, Groups: []uint32{50, 29}, Home: "/home/app"}}
	if !reflect.DeepEqual(id, want) {
		t.Errorf("identity %+v, want %+v", id, want)
	}
	// The image's passwd is not read through a symlink out of it: the
	// link's target is looked up inside the root, where it is missing.
	outside := filepath.Join(t.TempDir(), "passwd")
	os.WriteFile(outside, []byte(testPasswd), 0o644)
	os.Remove(filepath.Join(root, "etc/passwd"))
	os.Symlink(outside, filepath.Join(root, "etc/passwd"))
	if id, err := NewIdentity(root, ociboot.Config{User: "app"}); err == nil {
		t.Errorf("user app found through a symlink out of the root: %+v", id)
	}
}
