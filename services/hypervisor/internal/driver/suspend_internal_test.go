package driver

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// A saved state is bound to its VM and vTPM: the manifest's checks refuse a
// state copied from another VM, one of another vTPM or QEMU, and a state
// file of another size; a record without a directory never names a path.
func TestSavedStateBinding(t *testing.T) {
	root := t.TempDir()
	d := New(Config{StateDir: root, QEMUVersion: qemu.Version{Major: 7, Minor: 2, Micro: 22}}, slog.New(slog.DiscardHandler))
	rec := func(id string) *storepb.VirtualMachine {
		dir := filepath.Join(root, "vms", id)
		return &storepb.VirtualMachine{Id: id, Paths: &hypervisorv1.Paths{Dir: dir, QmpSocket: filepath.Join(dir, "qmp.sock")},
			Tpm: &storepb.TpmKeys{EkPublic: []byte("ek of " + id), AkPublic: []byte("ak of " + id)}}
	}
	save := func(r *storepb.VirtualMachine, mutate func(*Manifest)) {
		t.Helper()
		dir := savedDir(r)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, stateFile), []byte("state"), 0o600); err != nil {
			t.Fatal(err)
		}
		argv := []string{"-qmp", "unix:" + r.GetPaths().GetQmpSocket() + ",server=on,wait=off"}
		m := Manifest{Format: manifestFormat, VMID: r.GetId(), EKSHA256: fingerprint(r.GetTpm().GetEkPublic()), AKSHA256: fingerprint(r.GetTpm().GetAkPublic()),
			QEMUVersion: "7.2.22", Argv: argv, ArgvSHA256: argvHash(argv), Size: 5}
		if mutate != nil {
			mutate(&m)
		}
		if err := writeFileSync(filepath.Join(dir, manifestFile), m); err != nil {
			t.Fatal(err)
		}
	}
	a, b := rec("0a0a0a0a"), rec("0b0b0b0b")
	save(a, nil)
	if err := d.Saved(a); err != nil {
		t.Fatalf("a's own state: %v", err)
	}
	for _, c := range []struct {
		name   string
		mutate func(*Manifest)
		want   string
	}{
		{"another vm's id", func(m *Manifest) { m.VMID = a.GetId() }, "belongs to vm"},
		{"another vm's argv", func(m *Manifest) {
			m.Argv = []string{"-qmp", "unix:" + a.GetPaths().GetQmpSocket()}
			m.ArgvSHA256 = argvHash(m.Argv)
		}, "another vm's directory"},
		{"another vTPM", func(m *Manifest) { m.AKSHA256 = fingerprint([]byte("ak of " + a.GetId())) }, "another vTPM"},
		{"another QEMU", func(m *Manifest) { m.QEMUVersion = "8.2.0" }, "made by qemu 8.2.0"},
		{"a truncated file", func(m *Manifest) { m.Size = 6 }, "its manifest says 6"},
		{"an edited argv", func(m *Manifest) { m.Argv = append(m.Argv, "-S") }, "does not match its hash"},
	} {
		save(b, func(m *Manifest) {
			if c.name != "another vm's id" {
				m.VMID = b.GetId()
			}
			c.mutate(m)
		})
		if err := d.Saved(b); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
	// a's state copied into b's directory as a whole.
	if err := os.RemoveAll(savedDir(b)); err != nil {
		t.Fatal(err)
	}
	if err := os.CopyFS(savedDir(b), os.DirFS(savedDir(a))); err != nil {
		t.Fatal(err)
	}
	if err := d.Saved(b); err == nil || !strings.Contains(err.Error(), "belongs to vm") {
		t.Errorf("a's state in b's directory: %v", err)
	}
	// No directory in the record: nothing is named, nothing removed.
	empty := &storepb.VirtualMachine{Id: "0c0c0c0c"}
	if savedDir(empty) != "" || d.Saved(empty) == nil || d.DiscardSaved(empty) != nil {
		t.Error("a record without a directory")
	}
}
