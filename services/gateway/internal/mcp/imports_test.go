package mcp

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

func (f *fakeHypervisor) ImportImage(req *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
	f.record(ss.Context())
	if f.importImage == nil {
		return f.UnimplementedHypervisorServiceServer.ImportImage(req, ss)
	}
	return f.importImage(req, ss)
}

const (
	layerA = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	layerB = "sha256:fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
)

// importSteps are an import's progress, each a new phase or layer.
var importSteps = []*hypervisorv1.ImportImageResponse{
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING},
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS, BytesDone: 1_500_000, BytesTotal: 3_000_000, Layer: layerA},
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS, BytesDone: 3_000_000, BytesTotal: 3_000_000, Layer: layerB},
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_ROOT},
	{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_MEASURING},
}

var importedImage = &hypervisorv1.Image{
	Id: "python", Version: "3.12", Ref: "python_3.12", Kind: hypervisorv1.ImageKind_IMAGE_KIND_OCI,
	Kernel: "/images/boot_1.vmlinuz", Initrd: "/images/boot_1.initrd", KubernetesVersions: []string{},
	Oci: &hypervisorv1.OciSource{Reference: "localhost:5000/python:3.12", ManifestDigest: layerA, RootHash: "ab12", BootImage: "boot_1"},
}

// sendImport sends the steps, then DONE with the image.
func sendImport(ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
	for _, m := range importSteps {
		if err := ss.Send(m); err != nil {
			return err
		}
	}
	return ss.Send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_DONE, Image: importedImage})
}

// import_image relays the stream's progress as notifications with the
// client's token, numbered, all before the result, and answers the image in
// get_image's shape with unchanged.
func TestImportImageProgress(t *testing.T) {
	h := newHarness(t)
	reqs := make(chan *hypervisorv1.ImportImageRequest, 1)
	h.hv.importImage = func(req *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
		reqs <- proto.CloneOf(req)
		return sendImport(ss)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	params := &mcp.CallToolParams{Name: "import_image", Arguments: map[string]any{
		"source": "localhost:5000/python:3.12", "id": "python", "version": "3.12", "boot_image": "boot_1", "node": "n1",
	}}
	params.SetProgressToken("imp-1")
	res, err := h.session.CallTool(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	body := wantOK(t, res)
	want := &hypervisorv1.ImportImageRequest{Source: "localhost:5000/python:3.12", Id: "python", Version: "3.12", BootImage: "boot_1", Node: "n1"}
	if got := <-reqs; !proto.Equal(got, want) {
		t.Errorf("ImportImage got %v, want %v", got, want)
	}
	if got := h.hv.authSeen(); !slices.Equal(got, []string{testToken}) {
		t.Errorf("backend saw authorization %q", got)
	}

	// The result: {image, unchanged}, the image as get_image writes it.
	var got struct {
		Image     json.RawMessage `json:"image"`
		Unchanged *bool           `json:"unchanged"`
	}
	if err := json.Unmarshal([]byte(body), &got); err != nil || got.Unchanged == nil || *got.Unchanged {
		t.Fatalf("import_image = %s (%v)", body, err)
	}
	wantImg, err := restjson.Marshal(importedImage)
	if err != nil {
		t.Fatal(err)
	}
	if !jsonEqual(mustUnmarshal(t, got.Image), mustUnmarshal(t, wantImg)) {
		t.Errorf("image %s, want get_image's shape %s", got.Image, wantImg)
	}
	if !strings.Contains(body, `"kind": "oci"`) || !strings.Contains(body, "\n  \"unchanged\": false\n}") {
		t.Errorf("import_image text is not the indented REST shape:\n%s", body)
	}
	var structured any
	_ = json.Unmarshal([]byte(body), &structured)
	if b, _ := json.Marshal(res.StructuredContent); !jsonEqual(mustUnmarshal(t, b), structured) {
		t.Errorf("structuredContent %s is not the text %s", b, body)
	}

	wantMsgs := []string{
		"resolving localhost:5000/python:3.12",
		"layers 1.5/3.0 MB (sha256:0123456789ab…)",
		"layers 3.0/3.0 MB (sha256:fedcba987654…)",
		"writing the root",
		"measuring the boot chain",
		"imported python_3.12",
	}
	// The client dispatches notifications asynchronously: wait for the
	// last one the server sends.
	poll.Until(t, "the progress notification of the import's end", func() bool {
		return slices.ContainsFunc(h.progressSeen(), func(p *mcp.ProgressNotificationParams) bool { return p.Message == "imported python_3.12" })
	})
	var msgs []string
	for i, p := range h.progressSeen() {
		msgs = append(msgs, p.Message)
		if p.ProgressToken != "imp-1" || p.Progress != float64(i+1) {
			t.Errorf("notification %d: token %v, progress %v", i, p.ProgressToken, p.Progress)
		}
	}
	if !slices.Equal(msgs, wantMsgs) {
		t.Errorf("progress messages\n%q\nwant\n%q", msgs, wantMsgs)
	}
}

// Without a progress token: the result, no notification; unchanged passes.
func TestImportImageUnchangedWithoutToken(t *testing.T) {
	h := newHarness(t)
	h.hv.importImage = func(_ *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
		return ss.Send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_DONE, Image: importedImage, Unchanged: true})
	}
	body := wantOK(t, h.call(t, "import_image", map[string]any{"source": "localhost:5000/python:3.12"}))
	if !strings.Contains(body, `"unchanged": true`) {
		t.Errorf("import_image = %s", body)
	}
	if ps := h.progressSeen(); len(ps) != 0 {
		t.Errorf("progress without a token: %v", ps)
	}
}

// Cancelling the tool call cancels the import: the hypervisor's stream
// sees its context end.
func TestImportImageCancel(t *testing.T) {
	h := newHarness(t)
	ended := make(chan struct{})
	h.hv.importImage = func(_ *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
		if err := ss.Send(importSteps[0]); err != nil {
			return err
		}
		<-ss.Context().Done()
		close(ended)
		return ss.Context().Err()
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	params := &mcp.CallToolParams{Name: "import_image", Arguments: map[string]any{"source": "localhost:5000/python:3.12"}}
	params.SetProgressToken(7)
	callErr := make(chan error, 1)
	go func() {
		_, err := h.session.CallTool(ctx, params)
		callErr <- err
	}()
	poll.Until(t, "the import's first progress notification", func() bool { return len(h.progressSeen()) > 0 })
	cancel()
	select {
	case <-ended:
	case <-time.After(poll.Bound):
		t.Fatal("the hypervisor's import was not cancelled with the tool call")
	}
	select {
	case err := <-callErr:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("CallTool = %v, want context.Canceled", err)
		}
	case <-time.After(poll.Bound):
		t.Fatal("CallTool did not return")
	}
}

// The hypervisor's errors are the tool's, before or after progress.
func TestImportImageErrors(t *testing.T) {
	h := newHarness(t)
	// The default fake has no importer: Unimplemented is unsupported.
	wantError(t, h.call(t, "import_image", map[string]any{"source": "x/y:1"}), "unsupported: ")
	wantError(t, h.call(t, "import_image", map[string]any{}), `invalid_request: missing required argument "source"`)
	for _, c := range []struct {
		progress bool
		err      error
		want     string
	}{
		{false, apierr.Errorf(apierr.InvalidRequest, "layer %s: entry ../etc/passwd: a path out of the root", layerA),
			"invalid_request: layer " + layerA + ": entry ../etc/passwd: a path out of the root"},
		{false, apierr.Errorf(apierr.NotFound, "localhost:5000/nope:1: manifest unknown"), "not_found: localhost:5000/nope:1: manifest unknown"},
		{true, apierr.Errorf(apierr.ResourceExhausted, "the image is larger than --max-image-bytes 1073741824"), "resource_exhausted: the image is larger than"},
		{true, apierr.Errorf(apierr.Conflict, "python_3.12 exists with another manifest"), "conflict: python_3.12 exists"},
	} {
		h.hv.importImage = func(_ *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
			if c.progress {
				if err := ss.Send(importSteps[1]); err != nil {
					return err
				}
			}
			return apierr.ToStatus(c.err).Err()
		}
		wantError(t, h.call(t, "import_image", map[string]any{"source": "localhost:5000/python:3.12"}), c.want)
	}
	// A stream that ends without DONE is no result.
	h.hv.importImage = func(_ *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
		return ss.Send(importSteps[0])
	}
	wantError(t, h.call(t, "import_image", map[string]any{"source": "localhost:5000/python:3.12"}), "internal_error: the import of localhost:5000/python:3.12 ended without its result")
}

// The description says what the tool does and what comes next.
func TestImportImageTool(t *testing.T) {
	h := newHarness(t)
	res, err := h.session.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(res.Tools, func(tool *mcp.Tool) bool { return tool.Name == "import_image" })
	if i < 0 {
		t.Fatal("no import_image")
	}
	d := res.Tools[i].Description
	for _, want := range []string{"WRITES: import an OCI container image", "progress", "Cancelling the call cancels the import", "create_vm with image=<id>", "unchanged"} {
		if !strings.Contains(d, want) {
			t.Errorf("description does not say %q:\n%s", want, d)
		}
	}
	props := res.Tools[i].InputSchema.(map[string]any)["properties"].(map[string]any)
	for _, p := range []string{"source", "id", "version", "boot_image", "node"} {
		if _, ok := props[p]; !ok {
			t.Errorf("input schema has no %s", p)
		}
	}
}

func TestImportMessage(t *testing.T) {
	for _, c := range []struct {
		m    *hypervisorv1.ImportImageResponse
		want string
	}{
		{&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS, BytesDone: 12_345_678, BytesTotal: 45_600_000, Layer: "sha256:ab12cd34ef56ab12"}, "layers 12.3/45.6 MB (sha256:ab12cd34ef56…)"},
		{&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS, BytesDone: 999}, "layers 0.0 MB"},
		{&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS, Layer: "sha256:ab12"}, "layers 0.0 MB (sha256:ab12)"},
		{&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_DONE, Unchanged: true, Image: &hypervisorv1.Image{Ref: "python_3.12"}}, "python_3.12 was already imported"},
	} {
		if got := importMessage("src", c.m); got != c.want {
			t.Errorf("importMessage(%v) = %q, want %q", c.m, got, c.want)
		}
	}
}

func mustUnmarshal(t *testing.T, b []byte) any {
	t.Helper()
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	return v
}

func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}
