package guestapi

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// records is the VM manager's port: a map of records.
type records struct {
	mu      sync.Mutex
	recs    map[string]*storepb.VirtualMachine
	updates int
}

func (r *records) Record(id string) (*storepb.VirtualMachine, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rec, ok := r.recs[id]; ok {
		return proto.Clone(rec).(*storepb.VirtualMachine), nil
	}
	return nil, apierr.Errorf(apierr.NotFound, "vm %q not found", id)
}

func (r *records) Records() []*storepb.VirtualMachine {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*storepb.VirtualMachine
	for _, rec := range r.recs {
		out = append(out, proto.Clone(rec).(*storepb.VirtualMachine))
	}
	return out
}

func (r *records) Leased(network string, ip netip.Addr, fn func(*storepb.VirtualMachine)) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rec := range r.recs {
		if a, err := netip.ParseAddr(rec.GetIp()); err == nil && a == ip && rec.GetNetwork() == network {
			fn(rec)
			return true
		}
	}
	return false
}

func (r *records) Update(id string, fn func(*storepb.VirtualMachine)) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.updates++
	rec, ok := r.recs[id]
	if !ok {
		return apierr.Errorf(apierr.NotFound, "vm %q not found", id)
	}
	fn(rec)
	return nil
}

func (r *records) BeginBootRequest(rec *storepb.VirtualMachine) *attestationv1.BeginBootRequest {
	return &attestationv1.BeginBootRequest{VmId: rec.GetId(), Image: rec.GetImage(), Required: rec.GetRequireAttestation()}
}

// verifier is the attestation port: it releases user-data for a quote whose
// bytes are "good".
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
		Attestation: &attestationv1.Attestation{Required: true, UserDataReleased: v.released, Boot: 1}}, nil
}

const vmID = "0a0b0c0d"

// newSide is the guest side over one booting VM with user-data, on network
// "net", and an image directory with one sysupdate file.
func newSide(t *testing.T, v attestationv1.VerifierServiceClient) (*Side, *records) {
	t.Helper()
	dir := t.TempDir()
	images := filepath.Join(dir, "images")
	if err := os.MkdirAll(filepath.Join(images, "sysupdate", "kubernetes", "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(images, "sysupdate", "kubernetes", "SHA256SUMS"), []byte("aa  k.raw\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	vmDir := filepath.Join(dir, "vms", vmID)
	if err := os.MkdirAll(vmDir, 0o700); err != nil {
		t.Fatal(err)
	}
	ud := filepath.Join(vmDir, "user-data")
	if err := os.WriteFile(ud, []byte(`{"ignition":{}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	r := &records{recs: map[string]*storepb.VirtualMachine{vmID: {
		Id: vmID, Name: "t1", State: hypervisorv1.State_STATE_BOOTING, Phase: hypervisorv1.Phase_PHASE_BOOT, RequireAttestation: true,
		Network: "net", Ip: "10.0.0.2", SshAuthorizedKeys: []string{"ssh-ed25519 AAAA caller"},
		Attestation: &attestationv1.Attestation{Required: true, Boot: 1},
		Paths:       &hypervisorv1.Paths{Dir: vmDir, UserData: ud},
	}}}
	return New(r, r, v, Config{ImageDir: images}, slog.New(slog.DiscardHandler)), r
}

func TestAttestationGate(t *testing.T) {
	s, r := newSide(t, &verifier{})
	ctx := context.Background()
	if _, exists, released, err := s.UserData(vmID); err != nil || !exists || released {
		t.Fatalf("before attestation: exists %v released %v %v", exists, released, err)
	}
	if _, err := s.IssueNonce(ctx, vmID); err != nil {
		t.Fatal(err)
	}
	rec, _ := r.Record(vmID)
	if rec.GetState() != hypervisorv1.State_STATE_ATTESTING || rec.GetAttestation().GetNonceIssuedAt() == nil {
		t.Errorf("after the first nonce: %s", rec.GetState())
	}
	// Later nonces write nothing: a guest can ask for them in a loop.
	before := r.updates
	for range 10 {
		if _, err := s.IssueNonce(ctx, vmID); err != nil {
			t.Fatal(err)
		}
	}
	if r.updates != before {
		t.Errorf("10 more nonces wrote the record %d times", r.updates-before)
	}
	resp, err := s.SubmitQuote(ctx, vmID, &attestationv1.VerifyQuoteRequest{Stage: attestationv1.Stage_STAGE_INITRD, Quote: []byte("bad")})
	if err != nil || resp.GetVerified() {
		t.Fatalf("bad quote: %v %v", resp, err)
	}
	rec, _ = r.Record(vmID)
	if !strings.HasPrefix(rec.GetLastError(), "initrd attestation rejected: golden mismatch") {
		t.Errorf("lastError %q", rec.GetLastError())
	}
	if _, _, released, _ := s.UserData(vmID); released {
		t.Fatal("a rejected quote released user-data")
	}
	if _, err := s.SubmitQuote(ctx, vmID, &attestationv1.VerifyQuoteRequest{Stage: attestationv1.Stage_STAGE_INITRD, Quote: []byte("good")}); err != nil {
		t.Fatal(err)
	}
	data, _, released, err := s.UserData(vmID)
	if err != nil || !released || string(data) != `{"ignition":{}}` {
		t.Errorf("after a verified quote: %q %v %v", data, released, err)
	}
	rec, _ = r.Record(vmID)
	if rec.GetLastError() != "" || !rec.GetAttestation().GetUserDataReleased() {
		t.Errorf("record after a verified retry: lastError %q, %v", rec.GetLastError(), rec.GetAttestation())
	}
	if _, err := s.IssueNonce(ctx, "ffffffff"); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("unknown vm: %v", err)
	}
}

func TestGuestLookupsAndFiles(t *testing.T) {
	s, _ := newSide(t, &verifier{})
	if rec, ok := s.Network("net").ByIP(netip.MustParseAddr("10.0.0.2")); !ok || rec.GetId() != vmID {
		t.Errorf("ByIP: %v %v", rec, ok)
	}
	if _, ok := s.Network("net").ByIP(netip.MustParseAddr("10.0.0.3")); ok {
		t.Error("an unknown address found a vm")
	}
	if _, ok := s.Network("other").ByIP(netip.MustParseAddr("10.0.0.2")); ok {
		t.Error("another network's vm was found")
	}
	if keys := s.SSHKeys(vmID); len(keys) != 1 || keys[0] != "ssh-ed25519 AAAA caller" {
		t.Errorf("keys %q", keys)
	}
	if _, err := s.Report(vmID); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("report before upload: %v", err)
	}
	if err := s.StoreReport(vmID, []byte(`{"metrics":[1,2]}`)); err != nil {
		t.Fatal(err)
	}
	rep, err := s.Report(vmID)
	if err != nil || rep.GetReport().GetStructValue().GetFields()["metrics"] == nil {
		t.Errorf("report: %v %v", rep, err)
	}
	f, n, err := s.SysupdateFile(vmID, "kubernetes", "SHA256SUMS")
	if err != nil || n != 10 {
		t.Fatalf("sysupdate: %d %v", n, err)
	}
	b, _ := io.ReadAll(f)
	f.Close()
	if string(b) != "aa  k.raw\n" {
		t.Errorf("sysupdate content %q", b)
	}
	for _, bad := range [][2]string{{"kubernetes", "sub"}, {"..", "images"}, {"kubernetes", "../SHA256SUMS"}, {"kubernetes", "nope"}, {"", "x"}} {
		if _, _, err := s.SysupdateFile(vmID, bad[0], bad[1]); apierr.CodeOf(err) != apierr.NotFound {
			t.Errorf("sysupdate %q: %v", bad, err)
		}
	}
}

// TestIMDSSysupdateTraversal serves the guest side's files through the IMDS
// handler, with request-targets parsed as net/http's server parses them:
// the one file inside <image-dir>/sysupdate/<component>/ is served, nothing
// outside it is, whatever the encoding.
func TestIMDSSysupdateTraversal(t *testing.T) {
	s, _ := newSide(t, &verifier{})
	images := s.cfg.ImageDir
	const secret = "top secret"
	for _, p := range []string{
		filepath.Join(images, "secret"),
		filepath.Join(images, "sysupdate", "secret"),
		filepath.Join(filepath.Dir(images), "secret"),
		filepath.Join(images, "sysupdate", "kubernetes", "sub", "secret"),
	} {
		if err := os.WriteFile(p, []byte(secret), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Links: one inside the tree is followed, one out of it is not.
	if err := os.Symlink("SHA256SUMS", filepath.Join(images, "sysupdate", "kubernetes", "inside")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../../secret", filepath.Join(images, "sysupdate", "kubernetes", "outside")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(images, "secret"), filepath.Join(images, "sysupdate", "kubernetes", "absolute")); err != nil {
		t.Fatal(err)
	}
	h := imds.New(s.Network("net"), nil, nil)
	get := func(target string) *httptest.ResponseRecorder {
		raw := "GET " + target + " HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n"
		r, err := http.ReadRequest(bufio.NewReader(strings.NewReader(raw)))
		if err != nil {
			return nil
		}
		r.RemoteAddr = "10.0.0.2:40000"
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	base := imds.BasePath + "/sysupdate/"
	for _, name := range []string{"SHA256SUMS", "inside"} {
		if w := get(base + "kubernetes/" + name); w == nil || w.Code != 200 || w.Body.String() != "aa  k.raw\n" {
			t.Fatalf("the sysupdate file %s: %v", name, w)
		}
	}
	for _, target := range []string{
		base + "kubernetes/../secret",
		base + "kubernetes/../../secret",
		base + "kubernetes/%2e%2e/secret",
		base + "kubernetes/..%2Fsecret",
		base + "kubernetes/..%2F..%2Fsecret",
		base + "kubernetes/..%2F..%2F..%2Fsecret",
		base + "%2e%2e/secret",
		base + "..%2F../secret",
		base + "kubernetes/sub%2Fsecret",
		base + "kubernetes/sub",
		base + "kubernetes/sub/secret",
		base + "kubernetes/%2Fetc%2Fpasswd",
		base + "%2Fetc/passwd",
		base + "/etc/passwd",
		base + "kubernetes//etc/passwd",
		base + "kubernetes/..%5Csecret",
		base + "kubernetes/outside",
		base + "kubernetes/absolute",
		base + "kubernetes/secret%00",
		base + "kubernetes/.",
		base + "kubernetes",
		"http://169.254.169.254" + base + "kubernetes/%2e%2e/%2e%2e/secret",
	} {
		w := get(target)
		if w == nil {
			continue // net/http refuses it before any handler
		}
		if w.Code != http.StatusNotFound || strings.Contains(w.Body.String(), secret) {
			t.Errorf("%s: %d %q, want 404", target, w.Code, w.Body.String())
		}
	}
}

func (r *records) PoolMemberWaiting(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.recs[id].GetPool() != ""
}
