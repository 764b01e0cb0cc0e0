package apiserver

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

const img = "flatcar_4230.2.0"

var ctx = context.Background()

func hex32(c byte) string { return strings.Repeat(string([]byte{c, c}), 32) }

func policyDoc(t *testing.T, withGolden bool, goldenChar byte) *structpb.Struct {
	t.Helper()
	m := map[string]any{
		"image_id":      "flatcar",
		"image_version": "4230.2.0",
		"pcr11": map[string]any{
			"enter-initrd": hex32('a'),
			"enter-initrd:leave-initrd:sysinit:ready": hex32('b'),
		},
		"pcr13": map[string]any{"v1.33.1": hex32('c')},
	}
	if withGolden {
		m["golden"] = map[string]any{"sha256": map[string]any{
			"13": hex32(goldenChar), "0": hex32(goldenChar), "7": hex32(goldenChar),
		}}
		m["golden_firmware"] = map[string]any{"sha256": hex32('f'), "package": "ovmf"}
	}
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

type clock struct{ t time.Time }

func (c *clock) now() time.Time { c.t = c.t.Add(time.Second); return c.t }

func newServer(t *testing.T, path string, opts Options) (*Server, *policystore.Store, *clock) {
	t.Helper()
	st, err := policystore.Open(path)
	if err != nil {
		t.Fatalf("policystore.Open: %v", err)
	}
	t.Cleanup(func() { st.Close() })
	c := &clock{t: time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)}
	s := mustNew(t, st, opts)
	s.now = c.now
	if err := s.resetNonces(); err != nil { // on the test's clock
		t.Fatal(err)
	}
	c.t = c.t.Add(-time.Second) // that read it once; the tests count from here
	return s, st, c
}

func mustNew(t *testing.T, st *policystore.Store, opts Options) *Server {
	t.Helper()
	s, err := New(st, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func tempDB(t testing.TB) string { return filepath.Join(t.TempDir(), "attestation.db") }

func wantCode(t *testing.T, err error, code apierr.Code) {
	t.Helper()
	if err == nil {
		t.Fatalf("err = nil, want %s", code)
	}
	if got := apierr.CodeOf(err); got != code {
		t.Fatalf("CodeOf(%v) = %q, want %q", err, got, code)
	}
}

func TestStoreSurvivesReopen(t *testing.T) {
	path := tempDB(t)
	st, err := policystore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	s := mustNew(t, st, Options{})
	imported, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, true, '1')})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000abcd", Image: img, Required: true}); err != nil {
		t.Fatal(err)
	}
	// While open, a second Open of the same file is refused.
	if st2, err := policystore.Open(path); err == nil {
		st2.Close()
		t.Fatal("second policystore.Open of a held file succeeded")
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}

	st, err = policystore.Open(path)
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	defer st.Close()
	s = mustNew(t, st, Options{})
	got, err := s.GetImagePolicy(ctx, &attestationv1.GetImagePolicyRequest{Image: img})
	if err != nil {
		t.Fatalf("Get after reopen: %v", err)
	}
	if !proto.Equal(got, imported) {
		t.Errorf("after reopen %v\nwant %v", got, imported)
	}
	a, err := s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: "0000abcd"})
	if err != nil || a.GetBoot() != 1 || !a.GetRequired() {
		t.Errorf("vm after reopen = %v %v", a, err)
	}
}

func TestGetAttestationStatus(t *testing.T) {
	path := tempDB(t)
	cases := []struct {
		opts     Options
		warnings []string
	}{
		{Options{Mode: attestationv1.Mode_MODE_VERIFY}, nil},
		{Options{Mode: attestationv1.Mode_MODE_NOOP}, []string{"attestation=noop"}},
		{Options{Mode: attestationv1.Mode_MODE_VERIFY, LearnGolden: true}, []string{"learn mode"}},
		{Options{Mode: attestationv1.Mode_MODE_NOOP, LearnGolden: true}, []string{"attestation=noop", "learn mode"}},
	}
	st, err := policystore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := mustNew(t, st, Options{}).ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: policyDoc(t, false, 0)}); err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		resp, err := mustNew(t, st, c.opts).GetAttestationStatus(ctx, &attestationv1.GetAttestationStatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetMode() != c.opts.Mode || resp.GetLearnGolden() != c.opts.LearnGolden {
			t.Errorf("%+v: mode/learn = %v/%v", c.opts, resp.GetMode(), resp.GetLearnGolden())
		}
		if resp.GetPolicyCount() != 1 {
			t.Errorf("%+v: policy count = %d", c.opts, resp.GetPolicyCount())
		}
		if len(resp.GetWarnings()) != len(c.warnings) {
			t.Errorf("%+v: warnings = %q, want %d", c.opts, resp.GetWarnings(), len(c.warnings))
			continue
		}
		for i, w := range c.warnings {
			if !strings.Contains(resp.GetWarnings()[i], w) {
				t.Errorf("%+v: warning %d = %q, want %q", c.opts, i, resp.GetWarnings()[i], w)
			}
		}
	}
}

// A fork's boot is its parent's, continued: it is held to what the
// parent's boot measured (a UKI's first-boot command-line extra), not to
// what the fork's own next cold boot would add.
func TestForkInheritsTheParentsBoot(t *testing.T) {
	st, err := policystore.Open(tempDB(t))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	s := mustNew(t, st, Options{})
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000abcd", Image: img, KernelCmdlineExtra: "ignition.firstboot"}); err != nil {
		t.Fatal(err)
	}
	a, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000abce", Image: img, ForkedFrom: "0000abcd"})
	if err != nil {
		t.Fatal(err)
	}
	if a.GetForkedFrom() != "0000abcd" {
		t.Errorf("forked_from %q", a.GetForkedFrom())
	}
	fork, _, err := st.GetVM("0000abce")
	if err != nil {
		t.Fatal(err)
	}
	if fork.KernelCmdlineExtra != "ignition.firstboot" {
		t.Errorf("the fork's boot expects command-line extra %q, want the parent's", fork.KernelCmdlineExtra)
	}
	// Its next boot is its own.
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000abce", Image: img}); err != nil {
		t.Fatal(err)
	}
	if fork, _, _ = st.GetVM("0000abce"); fork.KernelCmdlineExtra != "" {
		t.Errorf("the fork's own boot expects %q", fork.KernelCmdlineExtra)
	}
}
