package vm

import (
	"context"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/gen/apierr"
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/store"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/store/storepb"
	"google.golang.org/grpc"
)

// verifier is the attestation port: it releases user-data for a quote whose
// message is "good".
type verifier struct {
	attestationv1.VerifierServiceClient
	released bool
}

func (v *verifier) IssueNonce(context.Context, *attestationv1.IssueNonceRequest, ...grpc.CallOption) (*attestationv1.IssueNonceResponse, error) {
	return &attestationv1.IssueNonceResponse{Nonce: make([]byte, 32)}, nil
}

func (v *verifier) VerifyQuote(_ context.Context, q *attestationv1.VerifyQuoteRequest, _ ...grpc.CallOption) (*attestationv1.VerifyQuoteResponse, error) {
	ok := string(q.GetQuote()) == "good"
	if ok && q.GetStage() == attestationv1.Stage_STAGE_INITRD {
		v.released = true
	}
	msg := "golden mismatch: pcr 0"
	if ok {
		msg = "verified"
	}
	return &attestationv1.VerifyQuoteResponse{Stage: q.GetStage(), Verified: ok, Message: msg,
		Attestation: &attestationv1.Attestation{Required: true, UserDataReleased: v.released}}, nil
}

func newTestManager(t *testing.T, v attestationv1.VerifierServiceClient) (*Manager, *machine) {
	t.Helper()
	dir := t.TempDir()
	st, err := store.Open(filepath.Join(dir, "hypervisor.db"))
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
	m, err := New(Config{StateDir: dir, ImageDir: images}, slog.New(slog.DiscardHandler), st, images2{}, v, notify.NewRouter())
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
	m.machines[rec.Id] = mc
	return m, mc
}

type images2 struct{}

func (images2) Get(ref string) (*hypervisorv1.Image, error) { return nil, apierr.ErrNotFound }
func (images2) Default() (*hypervisorv1.Image, error)       { return nil, apierr.ErrNotFound }

func TestAttestationGate(t *testing.T) {
	m, _ := newTestManager(t, &verifier{})
	ctx := context.Background()
	if _, exists, released, err := m.UserData("0a0b0c0d"); err != nil || !exists || released {
		t.Fatalf("before attestation: exists %v released %v %v", exists, released, err)
	}
	if _, err := m.IssueNonce(ctx, "0a0b0c0d"); err != nil {
		t.Fatal(err)
	}
	rec, _ := m.Get("0a0b0c0d")
	if rec.GetState() != hypervisorv1.State_STATE_ATTESTING || rec.GetAttestation().GetNonceIssuedAt() == nil {
		t.Errorf("after the first nonce: %s", rec.GetState())
	}
	resp, err := m.SubmitQuote(ctx, "0a0b0c0d", &attestationv1.VerifyQuoteRequest{Stage: attestationv1.Stage_STAGE_INITRD, Quote: []byte("bad")})
	if err != nil || resp.GetVerified() {
		t.Fatalf("bad quote: %v %v", resp, err)
	}
	rec, _ = m.Get("0a0b0c0d")
	if !strings.HasPrefix(rec.GetLastError(), "initrd attestation rejected: golden mismatch") {
		t.Errorf("lastError %q", rec.GetLastError())
	}
	if _, _, released, _ := m.UserData("0a0b0c0d"); released {
		t.Fatal("a rejected quote released user-data")
	}
	if _, err := m.SubmitQuote(ctx, "0a0b0c0d", &attestationv1.VerifyQuoteRequest{Stage: attestationv1.Stage_STAGE_INITRD, Quote: []byte("good")}); err != nil {
		t.Fatal(err)
	}
	data, _, released, err := m.UserData("0a0b0c0d")
	if err != nil || !released || string(data) != `{"ignition":{}}` {
		t.Errorf("after a verified quote: %q %v %v", data, released, err)
	}
	rec, _ = m.Get("0a0b0c0d")
	if rec.GetLastError() != "" || !rec.GetAttestation().GetUserDataReleased() {
		t.Errorf("record after a verified retry: lastError %q, %v", rec.GetLastError(), rec.GetAttestation())
	}
	if _, err := m.IssueNonce(ctx, "ffffffff"); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("unknown vm: %v", err)
	}
}

func TestGuestLookupsAndFiles(t *testing.T) {
	m, _ := newTestManager(t, &verifier{})
	if rec, ok := m.ByIP(mustAddr("10.0.0.2")); !ok || rec.GetId() != "0a0b0c0d" {
		t.Errorf("ByIP: %v %v", rec, ok)
	}
	if _, ok := m.ByIP(mustAddr("10.0.0.3")); ok {
		t.Error("an unknown address found a vm")
	}
	if keys := m.SSHKeys("0a0b0c0d"); len(keys) != 1 || keys[0] != "ssh-ed25519 AAAA caller" {
		t.Errorf("keys %q", keys)
	}
	if _, err := m.Report("0a0b0c0d"); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("report before upload: %v", err)
	}
	if err := m.StoreReport("0a0b0c0d", []byte(`{"metrics":[1,2]}`)); err != nil {
		t.Fatal(err)
	}
	r, err := m.Report("0a0b0c0d")
	if err != nil || r.GetReport().GetStructValue().GetFields()["metrics"] == nil {
		t.Errorf("report: %v %v", r, err)
	}
	f, n, err := m.SysupdateFile("kubernetes", "SHA256SUMS")
	if err != nil || n != 10 {
		t.Fatalf("sysupdate: %d %v", n, err)
	}
	b, _ := io.ReadAll(f)
	f.Close()
	if string(b) != "aa  k.raw\n" {
		t.Errorf("sysupdate content %q", b)
	}
	for _, bad := range [][2]string{{"kubernetes", "sub"}, {"..", "images"}, {"kubernetes", "../SHA256SUMS"}, {"kubernetes", "nope"}, {"", "x"}} {
		if _, _, err := m.SysupdateFile(bad[0], bad[1]); apierr.CodeOf(err) != apierr.NotFound {
			t.Errorf("sysupdate %q: %v", bad, err)
		}
	}
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }
