package ocirun

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/giantswarm/vm-manager/pkg/ociboot"
)

// testBusybox is a static busybox: the one hack/guest-image.sh unpacks, or
// $VMM_TEST_BUSYBOX.
func testBusybox(t *testing.T) string {
	for _, p := range []string{os.Getenv("VMM_TEST_BUSYBOX"), "../../../build/guest/busybox/bin/busybox"} {
		if p == "" {
			continue
		}
		if abs, err := filepath.Abs(p); err == nil {
			if _, err := os.Stat(abs); err == nil {
				return abs
			}
		}
	}
	t.Skip("no static busybox (run hack/guest-image.sh, or set VMM_TEST_BUSYBOX)")
	return ""
}

// requireMounts skips unless this is root with mount(2), loop devices,
// erofs, overlay and mkfs.erofs: what the guest has.
func requireMounts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts and loop devices")
	}
	for _, bin := range []string{"mkfs.erofs", "losetup"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("no %s", bin)
		}
	}
	fs, _ := os.ReadFile("/proc/filesystems")
	for _, f := range []string{"erofs", "overlay", "ext4"} {
		if !strings.Contains(string(fs), "\t"+f+"\n") {
			t.Skipf("the kernel has no %s", f)
		}
	}
	d := t.TempDir()
	if err := unix.Mount("tmpfs", d, "tmpfs", 0, ""); err != nil {
		t.Skipf("mount(2): %v", err)
	}
	unix.Unmount(d, 0)
}

func losetup(t *testing.T, file string, ro bool) string {
	args := []string{"--find", "--show"}
	if ro {
		args = append(args, "--read-only")
	}
	out, err := exec.Command("losetup", append(args, file)...).CombinedOutput()
	if err != nil {
		t.Skipf("losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return dev
}

// testBundle writes an erofs in the layout the host makes: rootfs/ with a
// busybox, and image.json.
func testBundle(t *testing.T, bb string, cfg ociboot.Config) string {
	dir := t.TempDir()
	rootfs := filepath.Join(dir, "tree", ociboot.RootfsDir)
	for _, d := range []string{"bin", "etc", "home/app"} {
		os.MkdirAll(filepath.Join(rootfs, d), 0o755)
	}
	b, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(rootfs, "bin/busybox"), b, 0o755)
	for _, a := range []string{"sh", "id", "cat", "wc", "ls", "echo"} {
		os.Symlink("busybox", filepath.Join(rootfs, "bin", a))
	}
	os.WriteFile(filepath.Join(rootfs, "etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(rootfs, "etc/group"), []byte("root:x:0:\napp:x:1000:\nstaff:x:50:app\n"), 0o644)
	os.Chown(filepath.Join(rootfs, "home/app"), 1000, 1000)
	j, _ := json.Marshal(cfg)
	os.WriteFile(filepath.Join(dir, "tree", ociboot.ConfigFile), j, 0o444)
	img := filepath.Join(dir, "root.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", "-T0", img, filepath.Join(dir, "tree")).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	return img
}

type lines struct {
	mu sync.Mutex
	l  []string
}

func (l *lines) add(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.l = append(l.l, s)
}

func (l *lines) get() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.l)
}

// mountOnce mounts the bundle and upper disk under dir, unmounting all at
// the end of the test or when unmount is called.
func mountOnce(t *testing.T, o Options, bundleDev, upperDev string) (r *Root, unmount func()) {
	var once sync.Once
	unmount = func() {
		once.Do(func() {
			for _, d := range []string{"root", "rw", "bundle"} {
				unix.Unmount(filepath.Join(o.Dir, d), unix.MNT_DETACH)
			}
		})
	}
	t.Cleanup(unmount)
	o.defaults()
	r, err := mountBundle(&o, bundleDev, upperDev)
	if err != nil {
		t.Fatal(err)
	}
	return r, unmount
}

// The whole mount and run path but device-mapper, on loop devices.
func TestMountAndRunOnLoopDevices(t *testing.T) {
	requireMounts(t)
	bb := testBusybox(t)
	cfg := ociboot.Config{
		ManifestDigest: "sha256:m", ConfigDigest: "sha256:c",
		Entrypoint: []string{"sh", "-c"},
		Cmd:        []string{`echo "marker FOO=$FOO uid=$(id -u) groups=$(id -G) dir=$(pwd) home=$HOME"; echo run >>runs; echo "runs $(wc -l <runs)"; echo to-stderr >&2; ls /proc/self/fd >/dev/null && echo proc-ok`},
		Env:        []string{"FOO=bar baz"},
		WorkingDir: "/home/app",
		User:       "app",
	}
	bundle := losetup(t, testBundle(t, bb, cfg), true)
	upperFile := filepath.Join(t.TempDir(), "upper.img")
	if err := os.WriteFile(upperFile, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Truncate(upperFile, 64<<20)
	upper := losetup(t, upperFile, false)

	var log lines
	o := Options{Dir: filepath.Join(t.TempDir(), "oci"), Busybox: bb, Logf: func(f string, a ...any) { log.add(fmt.Sprintf(f, a...)) }}
	for boot := 1; boot <= 2; boot++ {
		r, unmount := mountOnce(t, o, bundle, upper)
		state := map[int]string{1: "(new)", 2: "(kept from an earlier boot)"}[boot]
		if l := log.get(); !slices.ContainsFunc(l, func(s string) bool { return strings.HasSuffix(s, state) }) {
			t.Errorf("boot %d: no line ending %q in %q", boot, state, l)
		}
		r.SetNetwork([]net.IP{net.ParseIP("192.0.2.53")}, "vm1")
		if b, err := os.ReadFile(filepath.Join(r.Dir, "etc/resolv.conf")); err != nil || string(b) != "nameserver 192.0.2.53\n" {
			t.Errorf("resolv.conf in the root: %q, %v", b, err)
		}
		var out lines
		sup := r.Entrypoint(out.add)
		go sup.Run()
		select {
		case <-sup.Done():
		case <-time.After(30 * time.Second):
			sup.Stop(time.Second)
			t.Fatalf("entrypoint still running; output %q", out.get())
		}
		want := []string{
			"[entrypoint] marker FOO=bar baz uid=1000 groups=1000 50 dir=/home/app home=/home/app",
			fmt.Sprintf("[entrypoint] runs %d", boot),
			"[entrypoint] to-stderr",
			"[entrypoint] proc-ok",
		}
		if got := out.get(); !slices.Equal(got, want) {
			t.Errorf("boot %d: entrypoint output %q, want %q", boot, got, want)
		}
		// An exec session: the image's shell, env, directory and user.
		cmd, err := r.Command(context.Background(), []string{"-c", `echo "$FOO|$X|$(id -u)|$(pwd)"; cat /etc/hosts | wc -l`}, []string{"X=1"})
		if err != nil {
			t.Fatal(err)
		}
		if b, err := cmd.CombinedOutput(); err != nil || string(b) != "bar baz|1|1000|/home/app\n3\n" {
			t.Errorf("exec: %q, %v", b, err)
		}
		if boot == 2 {
			// An image without /bin/sh: vm-agent's busybox runs in the root.
			if err := os.Remove(filepath.Join(r.Dir, "bin/sh")); err != nil {
				t.Fatal(err)
			}
			cmd, err := r.Command(context.Background(), []string{"-c", `echo "no sh: $FOO $(id -u) $(pwd)"`}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if b, err := cmd.CombinedOutput(); err != nil || string(b) != "no sh: bar baz 1000 /home/app\n" {
				t.Errorf("exec without /bin/sh: %q, %v (%q)", b, err, cmd.Args)
			}
		}
		unmount()
	}
}
