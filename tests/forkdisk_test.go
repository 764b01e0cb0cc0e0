package tests

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// TestForkDisk forks a VM with a disk: a VM of an OCI image, whose
// writable layer is its disk (issue 28: disks copy-on-write). The forks
// read what the parent wrote before the fork; after it, parent and forks
// write apart, none sees another's new files. The parent's disk was frozen
// below a new layer: a suspend and resume of the parent, and a cold start
// of it, go on in that layer. Deleting the parent leaves a fork's disk
// whole, also across the fork's own cold start.
func TestForkDisk(t *testing.T) {
	busybox, err := filepath.Abs("../build/guest/busybox/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(busybox); err != nil {
		t.Fatalf("no static busybox (make guest-image builds it): %v", err)
	}
	dir := ociImageDir(t)
	host := ociRegistry(t)
	cfg := v1.Config{
		Entrypoint: []string{"/bin/sh", "-c"},
		Cmd:        []string{"while true; do sleep 1; done"},
		Env:        []string{"PATH=/bin"},
	}
	pushImage(t, host+"/shell:1", cfg, busyboxLayer(t, busybox))

	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: dir, Quiet: true})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })
	if _, l := a.importImage(fmt.Sprintf(`{"source":%q}`, host+"/shell:1")); l.Result == nil || l.Result.Phase != "done" {
		t.Fatalf("import: %+v", l)
	}

	parent := a.vm("POST", "/vms", `{"name":"disk-origin","image":"shell","memory_mib":512,"cpus":1}`, 201)
	mustSh := func(id, script string) string {
		t.Helper()
		r := a.sh(id, script)
		if r.ExitCode != 0 {
			t.Fatalf("%s in %s: %+v", script, id, r)
		}
		return r.Stdout
	}
	files := func(id string) string {
		t.Helper()
		return strings.Join(strings.Fields(mustSh(id, "ls /data")), " ")
	}
	// big is overwritten in place after the fork: the same disk blocks,
	// which a fork reads from its disk once its cache is gone (a cold
	// start), where the parent's write must not show.
	mustSh(parent.ID, "mkdir -p /data && echo written-before > /data/before && yes A | head -c 1048576 > /data/big && sync")
	sumA := mustSh(parent.ID, "md5sum < /data/big")

	resp := a.fork(parent.ID, 2)
	for _, f := range resp.Vms {
		if f.State != "ready" || f.ForkedFrom != parent.ID {
			t.Fatalf("fork %+v", f)
		}
		if got := mustSh(f.ID, "cat /data/before"); got != "written-before\n" {
			t.Errorf("fork %s reads %q of the parent's file", f.ID, got)
		}
		mustSh(f.ID, "echo "+f.ID+" > /data/fork-"+f.ID+" && sync")
	}
	mustSh(parent.ID, "echo written-after > /data/after && yes B | head -c 1048576 | dd of=/data/big conv=notrunc 2>/dev/null && sync")
	sumB := mustSh(parent.ID, "md5sum < /data/big")
	if sumB == sumA {
		t.Fatalf("the overwrite did not change the file: %s", sumB)
	}
	if got := files(parent.ID); got != "after before big" {
		t.Errorf("the parent's files: %s", got)
	}
	for _, f := range resp.Vms {
		if got := files(f.ID); got != "before big fork-"+f.ID {
			t.Errorf("fork %s's files: %s", f.ID, got)
		}
	}
	// Each fork's disk is an overlay of its own over links of the parent's
	// frozen layers.
	for _, f := range resp.Vms {
		layers, _ := filepath.Glob(filepath.Join(c.StateDir, "vms", f.ID, "disk*"))
		if len(layers) != 2 {
			t.Errorf("fork %s's disk files: %v, want the parent's raw disk and an overlay", f.ID, layers)
		}
	}

	// The parent goes on in its new layer: across a suspend and resume
	// (QEMU's argv still names the frozen one) and a cold start.
	a.vm("POST", "/vms/"+parent.ID+"/suspend", "", 200)
	a.vm("POST", "/vms/"+parent.ID+"/resume", "", 200)
	// In place again: into the new layer, never the frozen one the forks read.
	mustSh(parent.ID, "echo written-after-resume > /data/resumed && yes C | head -c 1048576 | dd of=/data/big conv=notrunc 2>/dev/null && sync")
	sumC := mustSh(parent.ID, "md5sum < /data/big")
	a.vm("POST", "/vms/"+parent.ID+"/stop", "", 200)
	a.waitState(parent.ID, "stopped", 2*time.Minute)
	a.vm("POST", "/vms/"+parent.ID+"/start", "", 200)
	a.waitState(parent.ID, "ready", 3*time.Minute)
	if got := files(parent.ID); got != "after before big resumed" {
		t.Errorf("the parent's files after a suspend, resume and cold start: %s", got)
	}
	if got := mustSh(parent.ID, "md5sum < /data/big"); got != sumC {
		t.Errorf("the parent's overwrite is lost across a cold start: md5 %s, want %s", got, sumC)
	}
	for _, f := range resp.Vms {
		if got := files(f.ID); got != "before big fork-"+f.ID {
			t.Errorf("fork %s's files after the parent wrote on: %s", f.ID, got)
		}
	}

	// The parent goes; a fork's disk stays whole, also cold.
	a.vm("DELETE", "/vms/"+parent.ID, "", 204)
	f := resp.Vms[0]
	a.vm("POST", "/vms/"+f.ID+"/stop", "", 200)
	a.waitState(f.ID, "stopped", 2*time.Minute)
	a.vm("POST", "/vms/"+f.ID+"/start", "", 200)
	a.waitState(f.ID, "ready", 3*time.Minute)
	if got := files(f.ID); got != "before big fork-"+f.ID {
		t.Errorf("fork %s's files after the parent's delete and a cold start: %s", f.ID, got)
	}
	if got := mustSh(f.ID, "cat /data/before /data/fork-"+f.ID); got != "written-before\n"+f.ID+"\n" {
		t.Errorf("fork %s's file contents: %q", f.ID, got)
	}
	if got := mustSh(f.ID, "md5sum < /data/big"); got != sumA {
		t.Errorf("fork %s reads a write of the parent after the fork (md5 %s, had %s, the parent wrote %s, then %s)", f.ID, got, sumA, sumB, sumC)
	}
}

// busyboxLayer is a root of a static busybox and its applets' links.
func busyboxLayer(t *testing.T, busybox string) v1.Layer {
	t.Helper()
	root := t.TempDir()
	bin := filepath.Join(root, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "busybox"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, applet := range []string{"sh", "ls", "cat", "echo", "mkdir", "sync", "sleep", "yes", "head", "dd", "md5sum"} {
		if err := os.Symlink("busybox", filepath.Join(bin, applet)); err != nil {
			t.Fatal(err)
		}
	}
	out := filepath.Join(t.TempDir(), "root.tar")
	tarDir(t, root, out)
	l, err := tarball.LayerFromFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return l
}
