package policysync

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
)

type catalog map[string]string

func (c catalog) List() []*hypervisorv1.Image {
	var out []*hypervisorv1.Image
	for ref := range c {
		out = append(out, &hypervisorv1.Image{Ref: ref})
	}
	return out
}

func (c catalog) PolicyDocument(ref string) ([]byte, bool) {
	d, ok := c[ref]
	return []byte(d), ok && d != ""
}

type synced struct {
	mu sync.Mutex
	m  map[string]string
}

func (s *synced) PolicySynced(ref string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[ref], nil
}

func (s *synced) SetPolicySynced(ref, digest string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[ref] = digest
	return nil
}

// attestation is down for its first call, refuses documents with "bad" in
// them, and counts imports.
type attestation struct {
	attestationv1.VerifierServiceClient
	mu      sync.Mutex
	calls   int
	imports map[string]int
}

func (a *attestation) SyncImagePolicy(_ context.Context, req *attestationv1.SyncImagePolicyRequest, _ ...grpc.CallOption) (*attestationv1.ImagePolicy, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls++
	if a.calls == 1 {
		return nil, apierr.Errorf(apierr.Unavailable, "connection refused")
	}
	if req.GetDocument().GetFields()["bad"] != nil {
		return nil, apierr.Invalidf("document", "enforces nothing")
	}
	a.imports[req.GetImage()]++
	return &attestationv1.ImagePolicy{Image: req.GetImage()}, nil
}

// Every policy reaches attestation once attestation answers; a refused one
// is not offered again, nor is an unchanged one on the next start.
func TestRun(t *testing.T) {
	cat := catalog{"a_1": `{"golden":{}}`, "b_1": `{"bad":true}`, "c_1": "", "d_1": `not json`}
	st := &synced{m: map[string]string{}}
	att := &attestation{imports: map[string]int{}}
	log := slog.New(slog.DiscardHandler)
	done := make(chan struct{})
	go func() { Run(context.Background(), log, cat, st, att); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not finish once attestation answered")
	}
	if att.imports["a_1"] != 1 || len(att.imports) != 1 || st.m["a_1"] == "" || st.m["b_1"] == "" || st.m["d_1"] != "" {
		t.Fatalf("imports %v, synced %v", att.imports, st.m)
	}
	calls := att.calls
	Run(context.Background(), log, cat, st, att)
	if att.calls != calls {
		t.Errorf("a second start offered %d documents again", att.calls-calls)
	}
}
