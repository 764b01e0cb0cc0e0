package mcp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/sdk/enumname"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// import_image (issue 27): ImportImage, a server stream, as one tool call
// that blocks until the image is in the catalog and reports the stream's
// progress as MCP progress notifications.

const importImageDescription = `WRITES: import an OCI container image into the image catalog so that VMs can boot it. source is a registry reference (host[:port]/repository[:tag|@digest], pulled with the hypervisor's registry credentials) or oci-layout:<dir>[:<tag>] on the host. Its layers become a read-only root (erofs behind dm-verity), booted by boot_image's kernel and measured once for attestation. Blocks until the image is in the catalog (minutes for a large image); sends progress notifications (layers, writing the root, measuring the boot chain) when the request carries a progress token. Cancelling the call cancels the import and leaves nothing behind. Returns {image, unchanged}: the catalog image (as get_image describes it), unchanged true when that exact manifest was already imported as <id>_<version>. Next: create_vm with image=<id> (its newest version) or image=<image.ref>. Errors: invalid_request (a broken or hostile image; the message names the layer and entry), not_found (no such reference), conflict (<id>_<version> exists with another manifest: give another version), resource_exhausted (larger than the hypervisor's --max-image-bytes or its image store quota), unsupported (this hypervisor does not import images).`

type importImageArgs struct {
	Source    string `json:"source" jsonschema:"a registry reference, host[:port]/repository[:tag|@digest] (for example localhost:5000/python:3.12), or oci-layout:<dir>[:<tag>] for an OCI layout directory on the host"`
	ID        string `json:"id,omitempty" jsonschema:"the catalog id; default: the repository's last path element (python for localhost:5000/python:3.12)"`
	Version   string `json:"version,omitempty" jsonschema:"the catalog version; default: the tag, else sha256-<12 hex> of the digest"`
	BootImage string `json:"boot_image,omitempty" jsonschema:"the catalog image whose kernel and initrd boot it; default: the hypervisor's --oci-boot-image"`
	Node      string `json:"node,omitempty" jsonschema:"fleet gateway only: the node to import on (get_host lists them); default: every node"`
}

// importResult is import_image's result: the image in get_image's shape,
// and whether it was in the catalog already.
type importResult struct {
	image     *hypervisorv1.Image
	unchanged bool
}

func (r importResult) MarshalJSON() ([]byte, error) {
	img, err := restjson.Marshal(r.image)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	buf.WriteString(`{"image":`)
	if err := json.Compact(&buf, img); err != nil {
		return nil, err
	}
	fmt.Fprintf(&buf, `,"unchanged":%t}`, r.unchanged)
	return buf.Bytes(), nil
}

// importOutput is import_image's output schema: get_image's for the image.
func importOutput() output {
	img, err := outputOf[*hypervisorv1.Image]()
	if err != nil {
		panic(fmt.Sprintf("mcp: import_image: %v", err))
	}
	return output{schema: &jsonschema.Schema{
		Type: "object",
		Properties: map[string]*jsonschema.Schema{
			"image":     img.schema,
			"unchanged": {Type: "boolean", Description: "that exact manifest was already in the catalog as this id and version: nothing was written"},
		},
		PropertyOrder: []string{"image", "unchanged"},
		Required:      []string{"image", "unchanged"},
	}}
}

// importImage runs the import, reporting its progress while it streams,
// and answers its last message (phase DONE). The call's context is the
// import's: a cancelled tool call cancels it.
func (t *tools) importImage(ctx context.Context, req *mcp.CallToolRequest, in *importImageArgs) (importResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := t.hv.ImportImage(ctx, &hypervisorv1.ImportImageRequest{
		Source: in.Source, Id: in.ID, Version: in.Version, BootImage: in.BootImage, Node: in.Node,
	})
	if err != nil {
		return importResult{}, err
	}
	p := newImportProgress(req, in.Source, t.log)
	for {
		m, err := stream.Recv()
		if err == io.EOF {
			return importResult{}, apierr.Errorf(apierr.Internal, "the import of %s ended without its result", in.Source)
		}
		if err != nil {
			return importResult{}, err
		}
		if m.GetPhase() != hypervisorv1.ImportPhase_IMPORT_PHASE_DONE {
			p.report(ctx, m)
			continue
		}
		if m.GetImage() == nil {
			return importResult{}, apierr.Errorf(apierr.Internal, "the import of %s ended without its image", in.Source)
		}
		p.report(ctx, m) // before the result, as the other notifications
		return importResult{image: m.GetImage(), unchanged: m.GetUnchanged()}, nil
	}
}

// importProgressEvery bounds how often the layer counts are reported: a
// new phase or a new layer is reported at once.
const importProgressEvery = 250 * time.Millisecond

// importProgress reports an import's messages as progress notifications,
// numbered from 1, when the client gave a progress token.
type importProgress struct {
	session *mcp.ServerSession
	token   any
	source  string
	log     *slog.Logger

	n     int
	phase hypervisorv1.ImportPhase
	layer string
	last  time.Time
}

// newImportProgress is nil (reporting nothing) without a token.
func newImportProgress(req *mcp.CallToolRequest, source string, log *slog.Logger) *importProgress {
	if req == nil || req.Params == nil || req.Session == nil {
		return nil
	}
	token := req.Params.GetProgressToken()
	if token == nil {
		return nil
	}
	return &importProgress{session: req.Session, token: token, source: source, log: log}
}

func (p *importProgress) report(ctx context.Context, m *hypervisorv1.ImportImageResponse) {
	if p == nil {
		return
	}
	now := time.Now()
	if p.n > 0 && m.GetPhase() == p.phase && m.GetLayer() == p.layer && now.Sub(p.last) < importProgressEvery {
		return
	}
	p.n++
	p.phase, p.layer, p.last = m.GetPhase(), m.GetLayer(), now
	err := p.session.NotifyProgress(ctx, &mcp.ProgressNotificationParams{
		ProgressToken: p.token,
		Progress:      float64(p.n),
		Message:       importMessage(p.source, m),
	})
	if err != nil {
		p.log.Debug("import_image progress: notify", "source", p.source, "error", err)
	}
}

// importMessage is a progress message: "layers 12.3/45.6 MB
// (sha256:ab12cd34ef56…)", "writing the root", ….
func importMessage(source string, m *hypervisorv1.ImportImageResponse) string {
	switch m.GetPhase() {
	case hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING:
		return "resolving " + source
	case hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS:
		s := "layers " + megabytes(m.GetBytesDone())
		if m.GetBytesTotal() > 0 {
			s += "/" + megabytes(m.GetBytesTotal())
		}
		s += " MB"
		if l := m.GetLayer(); l != "" {
			s += " (" + shortDigest(l) + ")"
		}
		return s
	case hypervisorv1.ImportPhase_IMPORT_PHASE_ROOT:
		return "writing the root"
	case hypervisorv1.ImportPhase_IMPORT_PHASE_MEASURING:
		return "measuring the boot chain"
	case hypervisorv1.ImportPhase_IMPORT_PHASE_DONE:
		if m.GetUnchanged() {
			return m.GetImage().GetRef() + " was already imported"
		}
		return "imported " + m.GetImage().GetRef()
	}
	return enumname.Of(m.GetPhase())
}

func megabytes(b int64) string { return fmt.Sprintf("%.1f", float64(b)/1e6) }

// shortDigest is a digest cut to 12 hex characters, as docker shows them.
func shortDigest(d string) string {
	algo, hex, ok := strings.Cut(d, ":")
	if !ok {
		algo, hex = "", d
	} else {
		algo += ":"
	}
	if len(hex) <= 12 {
		return d
	}
	return algo + hex[:12] + "…"
}
