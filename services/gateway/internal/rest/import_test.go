package rest

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// fakeImport answers ImportImage with canned messages, then err (nil: the
// stream's end).
type fakeImport struct {
	hypervisorv1.HypervisorServiceClient
	msgs    []*hypervisorv1.ImportImageResponse
	err     error
	openErr error // the call itself fails
	req     *hypervisorv1.ImportImageRequest
	auth    []string
}

func (f *fakeImport) ImportImage(ctx context.Context, req *hypervisorv1.ImportImageRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[hypervisorv1.ImportImageResponse], error) {
	f.req = req
	md, _ := metadata.FromOutgoingContext(ctx)
	f.auth = md.Get("authorization")
	if f.openErr != nil {
		return nil, f.openErr
	}
	return &importStream{f: f}, nil
}

type importStream struct {
	grpc.ClientStream
	f *fakeImport
	n int
}

func (s *importStream) Recv() (*hypervisorv1.ImportImageResponse, error) {
	if s.n < len(s.f.msgs) {
		s.n++
		return s.f.msgs[s.n-1], nil
	}
	if s.f.err == nil {
		return nil, io.EOF
	}
	return nil, s.f.err
}

var importMsgs = []*hypervisorv1.ImportImageResponse{
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING},
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS, BytesDone: 1 << 20, BytesTotal: 4 << 20, Layer: "sha256:ab12"},
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_ROOT},
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_MEASURING},
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_DONE, Image: &hypervisorv1.Image{Id: "python", Version: "3.12", Ref: "python_3.12", Kind: hypervisorv1.ImageKind_IMAGE_KIND_OCI}},
}

func serveImport(t *testing.T, f *fakeImport, target, body string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest("POST", target, strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("Authorization", "Bearer tok")
	w := httptest.NewRecorder()
	Import(f, slog.New(slog.DiscardHandler)).ServeHTTP(w, r)
	return w
}

// A line per message, {"result":…} in the REST shapes, the last with phase
// done and the image; the body in the REST request shape.
func TestImportNDJSON(t *testing.T) {
	f := &fakeImport{msgs: importMsgs}
	w := serveImport(t, f, ImportPath, `{"source":"localhost:5000/python:3.12","id":"python","boot_image":"boot_1","node":"n1"}`)
	want := &hypervisorv1.ImportImageRequest{Source: "localhost:5000/python:3.12", Id: "python", BootImage: "boot_1", Node: "n1"}
	if !proto.Equal(f.req, want) {
		t.Errorf("request %v, want %v", f.req, want)
	}
	if len(f.auth) != 1 || f.auth[0] != "Bearer tok" {
		t.Errorf("authorization %q not forwarded", f.auth)
	}
	lines := strings.Split(strings.TrimSuffix(w.Body.String(), "\n"), "\n")
	if w.Code != 200 || w.Header().Get("Content-Type") != "application/x-ndjson" || len(lines) != len(importMsgs) {
		t.Fatalf("%d %s:\n%s", w.Code, w.Header().Get("Content-Type"), w.Body)
	}
	for i, want := range []string{
		`{"result":{"phase":"resolving","bytesDone":0,"bytesTotal":0,"unchanged":false}}`,
		`{"result":{"phase":"layers","bytesDone":1048576,"bytesTotal":4194304,"layer":"sha256:ab12","unchanged":false}}`,
		`{"result":{"phase":"root","bytesDone":0,"bytesTotal":0,"unchanged":false}}`,
	} {
		if lines[i] != want {
			t.Errorf("line %d = %s, want %s", i, lines[i], want)
		}
	}
	var last struct {
		Result struct {
			Phase string
			Image struct{ Ref, Kind string }
		}
	}
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &last); err != nil || last.Result.Phase != "done" ||
		last.Result.Image.Ref != "python_3.12" || last.Result.Image.Kind != "oci" {
		t.Errorf("last line %s (%v)", lines[len(lines)-1], err)
	}
}

// Errors keep the envelope: before the first line with its status, after
// it as a last line.
func TestImportErrors(t *testing.T) {
	invalid := apierr.Errorf(apierr.InvalidRequest, "layer sha256:ab12: entry ../x: a path out of the root")
	for _, c := range []struct {
		name, target, body string
		f                  *fakeImport
		code               int
		want               string
	}{
		{"before the first message", ImportPath, `{"source":"s"}`, &fakeImport{err: apierr.ToStatus(invalid).Err()}, 400, string(apierr.RESTBody(invalid))},
		{"opening the call", ImportPath, `{"source":"s"}`, &fakeImport{openErr: apierr.ToStatus(apierr.Errorf(apierr.Unsupported, "no importer")).Err()}, 501,
			string(apierr.RESTBody(apierr.Errorf(apierr.Unsupported, "no importer")))},
		{"an unknown field", ImportPath, `{"source":"s","tag":"x"}`, &fakeImport{}, 400, ""},
		{"a query parameter", ImportPath + "?node=n1", `{"source":"s"}`, &fakeImport{}, 400, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := serveImport(t, c.f, c.target, c.body)
			var e struct {
				Error struct{ Code, Message string }
			}
			if w.Code != c.code || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Code == "" || (c.want != "" && w.Body.String() != c.want) {
				t.Errorf("%d %s, want %d %s", w.Code, w.Body, c.code, c.want)
			}
			if c.code == 400 && c.want == "" && c.f.req != nil {
				t.Errorf("a refused request reached the hypervisor: %v", c.f.req)
			}
		})
	}

	f := &fakeImport{msgs: importMsgs[:2], err: apierr.ToStatus(apierr.Errorf(apierr.ResourceExhausted, "larger than --max-image-bytes")).Err()}
	w := serveImport(t, f, ImportPath, `{"source":"s"}`)
	lines := strings.Split(strings.TrimSuffix(w.Body.String(), "\n"), "\n")
	if w.Code != 200 || len(lines) != 3 || lines[2] != `{"error":{"code":"resource_exhausted","message":"larger than --max-image-bytes"}}` {
		t.Errorf("%d:\n%s", w.Code, w.Body)
	}
}
