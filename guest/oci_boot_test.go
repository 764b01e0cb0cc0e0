package guest_test

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/sdnotify"
	"github.com/giantswarm/vm-manager/pkg/ociboot"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/giantswarm/vm-manager/pkg/verity"
)

// An imported OCI image's root, as the host attaches it: the test guest
// checks and measures its verity root, mounts it, runs its entrypoint
// (restarted after a failure); the same root with one byte flipped is
// refused, and the guest still becomes ready; booted again, the good root
// finds its upper disk as the first boot left it.
func TestBootOCIRoot(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a VM three times")
	}
	requireHost(t)
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("no mkfs.erofs (erofs-utils)")
	}
	img := guestImage(t)
	bb, err := filepath.Abs("../build/guest/busybox/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(bb); err != nil {
		t.Skipf("no static busybox: %v", err)
	}
	work := t.TempDir()
	rootImg := filepath.Join(work, "root.erofs")
	buildOCIRoot(t, bb, rootImg, ociboot.Config{
		ManifestDigest: "sha256:test-manifest", ConfigDigest: "sha256:test-config",
		Entrypoint: []string{"/bin/sh", "-c"},
		// Fails on its first run only: the upper disk keeps /srv/ran.
		Cmd:        []string{`echo "oci-marker MARKER=$MARKER dir=$(pwd) uid=$(id -u)"; [ -e ran ] && exit 0; touch ran; exit 3`},
		Env:        []string{"MARKER=hello-from-the-image"},
		WorkingDir: "/srv",
	})
	root, hashFile := hashOCIRoot(t, rootImg)
	upper := filepath.Join(work, "upper.img")
	if err := os.WriteFile(upper, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(upper, 256<<20); err != nil {
		t.Fatal(err)
	}

	// The serial console ends lines with \r\n.
	const marker = "[entrypoint] oci-marker MARKER=hello-from-the-image dir=/srv uid=0\r\n"
	const exited = "vm-agent: entrypoint exited with status 0"
	console := bootWithOCIDisks(t, img, root.Cmdline(), rootImg, hashFile, upper, exited)
	rootHex := hex.EncodeToString(root.RootHash)
	for _, want := range []string{
		"vm-agent: modules loaded: ",
		fmt.Sprintf("vm-agent: OCI root: \"verity-root:%s\" extended into PCR 15", rootHex),
		"vm-agent: OCI root: dm-verity device /dev/mapper/oci-root",
		"vm-agent: OCI root: image sha256:test-manifest (config sha256:test-config)",
		"vm-agent: OCI root mounted on /oci/root: /dev/mapper/oci-root read-only under an overlay on /dev/vdc (new)",
		"vm-agent: entrypoint started, pid ",
		marker,
		"vm-agent: entrypoint exited with status 3 after ",
		"; restarting in 1s",
		exited,
		"vm-agent: ready",
	} {
		if !strings.Contains(console, want) {
			t.Errorf("console lacks %q", want)
		}
	}
	if n := strings.Count(console, marker); n != 2 {
		t.Errorf("the entrypoint ran %d times, want 2 (a failure, then a restart)", n)
	}
	if m := regexp.MustCompile(`vm-agent: modules loaded: .*\bdm-verity\b.*\boverlay\b`).FindString(console); m == "" {
		t.Error("dm_verity and overlay not among the loaded modules")
	}

	// One byte flipped in the middle of the root: refused, measured as found.
	b, err := os.ReadFile(rootImg)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0x01
	bad := filepath.Join(work, "root-flipped.erofs")
	if err := os.WriteFile(bad, b, 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := verity.Format(bytes.NewReader(b), int64(len(b)), io.Discard, verity.Params{Salt: root.Salt})
	if err != nil {
		t.Fatal(err)
	}
	console = bootWithOCIDisks(t, img, root.Cmdline(), bad, hashFile, upper, "vm-agent: ready")
	refusal := fmt.Sprintf("vm-agent: OCI root refused: verity root hash %x is not the command line's %s: not mounting it", got, rootHex)
	for _, want := range []string{refusal, fmt.Sprintf("vm-agent: OCI root: \"verity-root:%x\" extended into PCR 15", got), "vm-agent: ready"} {
		if !strings.Contains(console, want) {
			t.Errorf("flipped root: console lacks %q", want)
		}
	}
	for _, not := range []string{"[entrypoint]", "OCI root mounted", "dm-verity device"} {
		if strings.Contains(console, not) {
			t.Errorf("flipped root: console has %q", not)
		}
	}

	// The good root again: the upper disk kept what the first boot wrote.
	console = bootWithOCIDisks(t, img, root.Cmdline(), rootImg, hashFile, upper, exited)
	if !strings.Contains(console, "on /dev/vdc (kept from an earlier boot)") || strings.Count(console, marker) != 1 ||
		strings.Contains(console, "status 3") {
		t.Errorf("third boot: the upper disk's state was not kept")
	}
}

// buildOCIRoot writes the host's layout (rootfs/ with a busybox as /bin/sh,
// and image.json) as an erofs at out.
func buildOCIRoot(t *testing.T, busybox, out string, cfg ociboot.Config) {
	t.Helper()
	tree := t.TempDir()
	rootfs := filepath.Join(tree, ociboot.RootfsDir)
	if err := os.MkdirAll(filepath.Join(rootfs, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	bb, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rootfs, "bin/busybox"), bb, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{"sh", "id", "echo", "touch"} {
		if err := os.Symlink("busybox", filepath.Join(rootfs, "bin", a)); err != nil {
			t.Fatal(err)
		}
	}
	j, _ := json.Marshal(cfg)
	if err := os.WriteFile(filepath.Join(tree, ociboot.ConfigFile), j, 0o444); err != nil {
		t.Fatal(err)
	}
	if b, err := exec.Command("mkfs.erofs", "--quiet", "-T0", "--all-root", out, tree).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, b)
	}
}

// hashOCIRoot writes the verity hash device of the root at path beside it.
func hashOCIRoot(t *testing.T, path string) (ociboot.Root, string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	if fi.Size()%ociboot.BlockSize != 0 {
		t.Fatalf("%s: %d bytes, not whole blocks", path, fi.Size())
	}
	r := ociboot.Root{Salt: make([]byte, 32), DataBlocks: uint64(fi.Size() / ociboot.BlockSize)}
	rand.Read(r.Salt)
	hashFile := path + ".verity"
	h, err := os.Create(hashFile)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if r.RootHash, err = verity.Format(f, fi.Size(), h, verity.Params{Salt: r.Salt}); err != nil {
		t.Fatal(err)
	}
	return r, hashFile
}

// bootWithOCIDisks boots the test guest with the three disks and the root's
// command-line words, waits for READY=1 and then for until on the console,
// powers it off and returns the console.
func bootWithOCIDisks(t *testing.T, img, words, rootImg, hashFile, upper, until string) string {
	t.Helper()
	stem := filepath.Join(img, "test-guest_0.1.0")
	if v := os.Getenv("GUEST_VERSION"); v != "" {
		stem = filepath.Join(img, "test-guest_"+v)
	}
	cmdline, err := os.ReadFile(stem + ".cmdline")
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "vmm-oci-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	p := func(name string) string { return filepath.Join(dir, name) }
	consoleLog := p("console.log")
	defer func() {
		if t.Failed() {
			b, _ := os.ReadFile(consoleLog)
			t.Logf("console.log:\n%s", tail(b, 40))
		}
	}()
	vars, err := os.ReadFile(ovmfVars)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(p("ovmf_vars.fd"), vars, 0o600)
	os.Mkdir(p("tpm"), 0o700)
	swtpm := start(t, p("swtpm.log"), "swtpm", "socket", "--tpm2", "--tpmstate", "dir="+p("tpm"),
		"--ctrl", "type=unixio,path="+p("swtpm.sock"), "--flags", "not-need-init", "--terminate")
	waitSwtpm(t, p("swtpm.sock"), swtpm)
	disk := func(id, file, serial string, ro bool) []string {
		d := "if=none,id=" + id + ",format=raw,file=" + file
		if ro {
			d += ",readonly=on"
		}
		return []string{"-drive", d, "-device", "virtio-blk-pci,drive=" + id + ",serial=" + serial}
	}
	args := []string{"-machine", "q35", "-accel", "tcg", "-m", "512", "-smp", "1",
		"-nodefaults", "-display", "none", "-no-reboot",
		"-serial", "file:" + consoleLog,
		"-qmp", "unix:" + p("qmp.sock") + ",server=on,wait=off",
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file=" + ovmfCode,
		"-drive", "if=pflash,format=raw,unit=1,file=" + p("ovmf_vars.fd"),
		"-kernel", stem + ".vmlinuz", "-initrd", stem + ".initrd",
		"-append", strings.TrimSpace(string(cmdline)) + " " + words,
		"-chardev", "socket,id=chrtpm,path=" + p("swtpm.sock"),
		"-tpmdev", "emulator,id=tpm0,chardev=chrtpm", "-device", "tpm-crb,tpmdev=tpm0",
		"-device", "virtio-rng-pci", "-device", "virtio-serial-pci",
		"-chardev", "socket,id=notify,path=" + p("notify.sock") + ",server=on,wait=off",
		"-device", "virtserialport,chardev=notify,name=" + sdnotify.PortName,
	}
	args = append(args, disk("ociroot", rootImg, ociboot.SerialRoot, true)...)
	args = append(args, disk("ociverity", hashFile, ociboot.SerialVerity, true)...)
	args = append(args, disk("ociupper", upper, ociboot.SerialUpper, false)...)
	started := time.Now()
	qemu := start(t, p("qemu.log"), "qemu-system-x86_64", args...)
	readUntilReady(t, p("notify.sock"), qemu, 120*time.Second)
	t.Logf("READY=1 after %.1fs", time.Since(started).Seconds())
	// The entrypoint's output may follow READY=1.
	poll.UntilWithin(t, 30*time.Second, fmt.Sprintf("%q in the console after READY=1", until), func() bool {
		b, _ := os.ReadFile(consoleLog)
		return bytes.Contains(b, []byte(until))
	})
	powerDown(t, p("qmp.sock"), qemu, consoleLog)
	if err := swtpm.wait(10 * time.Second); err != nil {
		t.Errorf("swtpm after qemu exit: %v", err)
	}
	b, _ := os.ReadFile(consoleLog)
	return string(b)
}
