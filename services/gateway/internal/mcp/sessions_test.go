package mcp

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/logging/logtest"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
)

// sockets do not exist, dialled as the gateway dials them. ended is closed
// once the server has handled the session's DELETE (the client's Close).
func noBackendSession(t *testing.T, log *slog.Logger) (cs *mcp.ClientSession, ended <-chan struct{}) {
	t.Helper()
	dial := func(name string) *grpc.ClientConn {
		conn, err := mesh.DialBackend(t.TempDir()+"/nothing.sock", name)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	h := New(hypervisorv1.NewHypervisorServiceClient(dial("hypervisor")), attestationv1.NewAttestationServiceClient(dial("attestation")), log, nil)
	deleted := make(chan struct{})
	var once sync.Once
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r)
		if r.Method == http.MethodDelete {
			once.Do(func() { close(deleted) })
		}
	}))
	t.Cleanup(ts.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(ctx, &mcp.StreamableClientTransport{Endpoint: ts.URL}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return cs, deleted
}

func TestBackendDown(t *testing.T) {
	cs, _ := noBackendSession(t, nil)
	t.Cleanup(func() { _ = cs.Close() })
	h := &harness{session: cs}
	wantError(t, h.call(t, "get_host", nil), "unavailable: the hypervisor service is unavailable: ")
	wantError(t, h.call(t, "get_vm_attestation", map[string]any{"id": "0a1b2c3d"}), "unavailable: the attestation service is unavailable: ")
	// get_info needs no backend.
	wantOK(t, h.call(t, "get_info", nil))
}

// TestSessionsQuietAtInfo: an MCP client's session (connect, a call, close)
// writes nothing at info; the SDK's lifecycle lines are debug.
func TestSessionsQuietAtInfo(t *testing.T) {
	for _, level := range []slog.Level{slog.LevelInfo, slog.LevelDebug} {
		t.Run(level.String(), func(t *testing.T) {
			var logs logtest.Buffer
			cs, ended := noBackendSession(t, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: level})))
			wantOK(t, (&harness{session: cs}).call(t, "get_info", nil))
			_ = cs.Close()
			// The server ends the session on the client's DELETE, and its
			// handler returns once the session is closed: the SDK has logged
			// the disconnect by then (at debug, the check below sees it), so
			// at info an empty log is the SDK's whole say.
			select {
			case <-ended:
			case <-time.After(poll.Bound):
				t.Fatal("the server did not handle the session's DELETE")
			}
			got := logs.String()
			switch level {
			case slog.LevelInfo:
				if got != "" {
					t.Errorf("a session at info logged:\n%s", got)
				}
			case slog.LevelDebug:
				for _, want := range []string{"level=DEBUG msg=\"server session connected\"", "level=DEBUG msg=\"session initialized\"", "level=DEBUG msg=\"server session disconnected\""} {
					if !strings.Contains(got, want) {
						t.Errorf("debug log lacks %s:\n%s", want, got)
					}
				}
			}
		})
	}
}
