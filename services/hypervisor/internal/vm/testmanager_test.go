package vm

import (
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

func newTestManager(t *testing.T, v attestationv1.VerifierServiceClient) (*testVMs, *machine) {
	t.Helper()
	dir := t.TempDir()
	st, err := vmstore.Open(filepath.Join(dir, "hypervisor.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	images := filepath.Join(dir, "images")
	if err := os.MkdirAll(filepath.Join(images, "sysupdate", "kubernetes", "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(images, "sysupdate", "kubernetes", "SHA256SUMS"), []byte("aa  k.raw\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	m, err := assemble(Config{StateDir: dir, ImageDir: images}, slog.New(slog.DiscardHandler), st, images2{}, v, notify.NewRouter(), newFakeDriver())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	vmDir := filepath.Join(dir, "vms", "0a0b0c0d")
	if err := os.MkdirAll(vmDir, 0o700); err != nil {
		t.Fatal(err)
	}
	ud := filepath.Join(vmDir, "user-data")
	if err := os.WriteFile(ud, []byte(`{"ignition":{}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	rec := &storepb.VirtualMachine{Id: "0a0b0c0d", Name: "t1", State: hypervisorv1.State_STATE_BOOTING, RequireAttestation: true, Ip: "10.0.0.2",
		SshAuthorizedKeys: []string{"ssh-ed25519 AAAA caller"},
		Attestation:       &attestationv1.Attestation{Required: true},
		Paths:             &hypervisorv1.Paths{Dir: vmDir, UserData: ud}}
	mc := &machine{id: rec.Id, rec: rec, changed: make(chan struct{})}
	m.mu.Lock()
	m.machines[rec.Id] = mc
	m.mu.Unlock()
	// No loops: the tests change the record first (m.RunLoops() after, where a test needs them).
	return m, mc
}

type images2 struct{}

func (images2) Get(ref string) (*hypervisorv1.Image, error) { return nil, apierr.ErrNotFound }
func (images2) Default() (*hypervisorv1.Image, error)       { return nil, apierr.ErrNotFound }
