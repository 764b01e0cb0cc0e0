// Package mcp is vm-manager's MCP server: the 20 tools of the contract (§2),
// served with streamable HTTP, each a thin call into the hypervisor or
// attestation backend.
//
// Conventions:
//   - a tool result is one text content holding the REST body of the same
//     operation (restjson, 2-space-indented JSON), and the same JSON as
//     structuredContent, described by the tool's outputSchema (a list is
//     {"<name>": [...]} there, as MCP wants an object);
//   - a failure is a tool result with isError and the text "<code>: <message>"
//     (the apierr code the backend sent); bad or missing arguments are
//     "invalid_request: …"; an unknown tool is a protocol error;
//   - arguments are taken as leniently as the original took them: undeclared
//     ones are ignored, integers may be strings, 0 or "" may mean the default
//     (decodeArgs);
//   - tools/list is sorted by name, as the original's mcp-go listed them;
//   - a POST is answered as SSE when its Accept names text/event-stream,
//     else as plain JSON (negotiate);
//   - the caller's HTTP Authorization header is forwarded to the backend as
//     the gRPC metadata "authorization".
package mcp

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strings"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/buildinfo"
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc/metadata"
)

// ServerName is the MCP implementation name.
const ServerName = "vm-manager"

// MaxRequestBodyBytes caps an MCP request: REST's 8 MiB for user_data plus
// room for the JSON-RPC envelope and string escaping.
const MaxRequestBodyBytes = 9 << 20

// SessionTimeout closes sessions idle for this long; clients re-initialize.
const SessionTimeout = time.Hour

// Instructions is the server's instructions text (contract §2.3).
const Instructions = `vm-manager provisions cloud-like virtual machines on this host for the CAPI cluster-manager: each VM gets an IMDS (instance metadata at 169.254.169.254), a vTPM, measured boot with remote attestation, an immutable mkosi-built OS and a Kubernetes sysext.

Workflow: call get_host first and check that it is ready (missing lists what is not). Then list_images / get_image to pick an image and Kubernetes version (import_image adds an OCI container image, such as a registry's python:3.12, to the catalog), then a network (create_network, or the "default" network the server creates at startup), then create_vm.

States: creating -> installing (the installer copies the OS onto the disk) -> booting (the installed boot) -> attesting (attestation is required and the guest fetched its first nonce) -> ready (the guest sent READY=1). A VM whose guest never sends READY=1 within the boot timeout becomes running: it is up but not ready. stopping and stopped follow stop_vm; failed means lastError says why; deleting while delete_vm runs.

create_vm blocks per wait_for: none returns once the installer started, installed once the OS is on the disk, attested once the installed boot released user_data, ready (the default) once the guest sent READY=1. A timeout error still leaves the VM running: follow it with get_vm. A failed create names the VM id; the VM still exists until you delete_vm it.

user_data is CAPI's bootstrap Secret as Ignition JSON. It is released to the guest only after a verified initrd quote (attestation), or right after the installed boot starts when require_attestation is false.

Debugging: get_vm for the state and lastError, get_vm_console for the serial console (the first place to look when a VM is failed or stuck), get_vm_attestation for the attestation verdicts, get_vm_metrics for resource usage. exec_vm runs a command in the guest as root over ssh. forward_port exposes a guest TCP port (for example 6443, the Kubernetes API) on a host loopback address. delete_network works only once no VM is attached to the network.

Warm pools: create_pool keeps VMs of one shape booted, attested and suspended; a create_vm of that shape then claims one and is ready in seconds (its fromPool says so), and skip_pool true boots a fresh VM instead. list_pools and get_pool show how many members are ready.`

// Observer is told how each tool call ended: code is "ok" or the error code
// of the result (invalid_request, not_found, …). The gateway counts them.
type Observer func(tool, code string, d time.Duration)

// New returns the MCP handler the gateway mounts at /mcp; observe may be nil.
func New(hv hypervisorv1.HypervisorServiceClient, at attestationv1.AttestationServiceClient, log *slog.Logger, observe Observer) http.Handler {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	srv := NewServer(hv, at, log)
	if observe != nil {
		srv.AddReceivingMiddleware(observed(observe))
	}
	if tracing.Enabled() {
		srv.AddReceivingMiddleware(traced) // outermost: the calls below run in its span
	}
	return negotiate(mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return srv }, &mcp.StreamableHTTPOptions{
		Logger:              sdkLogger(log),
		SessionTimeout:      SessionTimeout,
		MaxRequestBodyBytes: MaxRequestBodyBytes,
		// The gateway's cross-site guard (xsite) checks Host and Origin
		// before this handler, with the operator's --allowed-hosts, which
		// the SDK's loopback-only check would refuse.
		DisableLocalhostProtection: true,
	}))
}

// sdkLogger is log for the SDK, whose session lifecycle lines (connecting,
// connected, initialized, disconnected: four per MCP client) are info: they
// become debug, so that at info the gateway logs nothing per client or call.
// Warnings and errors pass unchanged.
func sdkLogger(log *slog.Logger) *slog.Logger {
	return slog.New(demoteInfo{log.Handler()})
}

type demoteInfo struct{ slog.Handler }

func demote(l slog.Level) slog.Level {
	if l < slog.LevelWarn {
		return min(l, slog.LevelDebug)
	}
	return l
}

func (d demoteInfo) Enabled(ctx context.Context, l slog.Level) bool {
	return d.Handler.Enabled(ctx, demote(l))
}

func (d demoteInfo) Handle(ctx context.Context, r slog.Record) error {
	r.Level = demote(r.Level)
	return d.Handler.Handle(ctx, r)
}

func (d demoteInfo) WithAttrs(attrs []slog.Attr) slog.Handler {
	return demoteInfo{d.Handler.WithAttrs(attrs)}
}

func (d demoteInfo) WithGroup(name string) slog.Handler { return demoteInfo{d.Handler.WithGroup(name)} }

// NewServer returns the MCP server with the 20 tools (toolDefs) registered.
func NewServer(hv hypervisorv1.HypervisorServiceClient, at attestationv1.AttestationServiceClient, log *slog.Logger) *mcp.Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := mcp.NewServer(&mcp.Implementation{Name: ServerName, Version: buildinfo.Version}, &mcp.ServerOptions{
		Instructions: Instructions,
		Logger:       sdkLogger(log),
		// Tools only, and they never change: no listChanged, no logging.
		Capabilities: &mcp.ServerCapabilities{Tools: &mcp.ToolCapabilities{ListChanged: false}},
	})
	t := &tools{hv: hv, at: at, log: log}
	for _, d := range toolDefs {
		d.add(s, t, d)
	}
	return s
}

// observed reports every tools/call with its outcome.
func observed(observe Observer) mcp.Middleware {
	return func(next mcp.MethodHandler) mcp.MethodHandler {
		return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
			call, ok := req.(*mcp.CallToolRequest)
			if method != "tools/call" || !ok || call.Params == nil {
				return next(ctx, method, req)
			}
			start := time.Now()
			res, err := next(ctx, method, req)
			code := "ok"
			switch r, _ := res.(*mcp.CallToolResult); {
			case err != nil:
				code = "protocol_error"
			case r != nil && r.IsError:
				code = "error"
				if len(r.Content) > 0 {
					if tc, ok := r.Content[0].(*mcp.TextContent); ok {
						if c, _, found := strings.Cut(tc.Text, ": "); found {
							code = c
						}
					}
				}
			}
			observe(call.Params.Name, code, time.Since(start))
			return res, err
		}
	}
}

// Info is get_info's result.
type Info struct {
	Version string   `json:"version"`
	Commit  string   `json:"commit"`
	Built   string   `json:"built"`
	Tools   []string `json:"tools"`
}

// BuildInfo is this binary's build, as get_info reports it. built is the
// commit time the go tool recorded (vcs.time), or "unknown".
func BuildInfo() Info {
	built := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.time" && s.Value != "" {
				built = s.Value
			}
		}
	}
	return Info{Version: buildinfo.Version, Commit: buildinfo.CommitOrVCS(), Built: built, Tools: append([]string(nil), ToolNames...)}
}

// annotation classes (contract §2.2).
type class int

const (
	hintRead class = iota
	hintCreate
	hintIdempotent
	hintDestructive
	hintExec
	// A lifetime change: it may stop or delete the VM later, and a ttl is
	// from now, so repeating it is not idempotent.
	hintLifetime
	// An import: it adds to the catalog and never replaces (a repeat
	// answers unchanged), and it reaches out to a registry.
	hintImport
)

func (c class) annotations() *mcp.ToolAnnotations {
	f, tr := false, true
	switch c {
	case hintRead:
		return &mcp.ToolAnnotations{ReadOnlyHint: true, DestructiveHint: &f, IdempotentHint: true, OpenWorldHint: &f}
	case hintCreate:
		return &mcp.ToolAnnotations{DestructiveHint: &f, OpenWorldHint: &f}
	case hintIdempotent:
		return &mcp.ToolAnnotations{DestructiveHint: &f, IdempotentHint: true, OpenWorldHint: &f}
	case hintDestructive:
		return &mcp.ToolAnnotations{DestructiveHint: &tr, IdempotentHint: true, OpenWorldHint: &f}
	case hintExec:
		return &mcp.ToolAnnotations{DestructiveHint: &tr, OpenWorldHint: &tr}
	case hintLifetime:
		return &mcp.ToolAnnotations{DestructiveHint: &tr, OpenWorldHint: &f}
	case hintImport:
		return &mcp.ToolAnnotations{DestructiveHint: &f, IdempotentHint: true, OpenWorldHint: &tr}
	}
	panic(fmt.Sprintf("unknown annotation class %d", c))
}

// toolDef is one tool: its name, annotation class (contract §2.2),
// description and body.
type toolDef struct {
	name        string
	class       class
	description string
	add         addFunc
}

// addFunc registers a tool under its definition; run makes one from a body.
type addFunc func(s *mcp.Server, t *tools, d toolDef)

// toolFunc is a tool's body: it gets validated arguments and a context that
// carries the caller's authorization, and returns what restjson marshals
// into the REST body (a proto message, a slice of them, or a plain value).
type toolFunc[In, Out any] func(t *tools, ctx context.Context, req *mcp.CallToolRequest, in *In) (Out, error)

// run registers fn: its input schema from In, its output schema from Out,
// its annotations from the class, and the common handling of arguments,
// authorization, results and errors.
func run[In, Out any](fn toolFunc[In, Out]) addFunc {
	return func(s *mcp.Server, t *tools, d toolDef) {
		out, err := outputOf[Out]()
		if err != nil {
			panic(fmt.Sprintf("mcp: tool %s: %v", d.name, err))
		}
		register(fn, out)(s, t, d)
	}
}

// register is run with the output given.
func register[In, Out any](fn toolFunc[In, Out], out output) addFunc {
	return func(s *mcp.Server, t *tools, d toolDef) {
		args, err := inputSchema[In]()
		if err != nil {
			panic(fmt.Sprintf("mcp: tool %s: %v", d.name, err))
		}
		tool := &mcp.Tool{Name: d.name, Description: d.description, InputSchema: args.schema, OutputSchema: out.schema, Annotations: d.class.annotations()}
		s.AddTool(tool, func(ctx context.Context, req *mcp.CallToolRequest) (*mcp.CallToolResult, error) {
			start := time.Now()
			var raw json.RawMessage
			if req.Params != nil {
				raw = req.Params.Arguments
			}
			in := new(In)
			ignored, err := decodeArgs(raw, args, in)
			if len(ignored) > 0 { // the first few: a caller can send a body full of them
				t.log.Debug("mcp tool call: undeclared arguments ignored", "tool", d.name, "count", len(ignored), "first", ignored[:min(len(ignored), 8)])
			}
			if err != nil {
				t.log.Debug("mcp tool call rejected", "tool", d.name, "error", err)
				return errorResult(apierr.Errorf(apierr.InvalidRequest, "%w", err)), nil
			}
			res, err := fn(t, withAuthorization(ctx, req), req, in)
			return t.result(d.name, out, res, err, time.Since(start)), nil
		})
	}
}

// result is a tool's result: res's REST body as text and as structured
// content, or the error text. A backend that cannot be reached already says
// so by name (mesh.DialBackend).
func (t *tools) result(name string, out output, res any, err error, d time.Duration) *mcp.CallToolResult {
	if err != nil {
		code := apierr.CodeOf(err)
		if apierr.HTTPStatus(code) >= 500 {
			t.log.Error("mcp tool call failed", "tool", name, "code", code, "error", apierr.MessageOf(err), "duration", d)
		} else {
			t.log.Debug("mcp tool call failed", "tool", name, "code", code, "error", apierr.MessageOf(err))
		}
		return errorResult(err)
	}
	var warnings []string
	if l, ok := res.(listed); ok {
		res, warnings = l.items, l.warnings
	}
	body, err := restjson.Marshaler{}.Marshal(res)
	if err != nil {
		t.log.Error("mcp tool result not encodable", "tool", name, "error", err)
		return errorResult(apierr.Errorf(apierr.Internal, "encoding the result: %w", err))
	}
	t.log.Debug("mcp tool call", "tool", name, "duration", d)
	result := &mcp.CallToolResult{
		Content:           []mcp.Content{&mcp.TextContent{Text: string(body)}},
		StructuredContent: out.structured(body),
	}
	if len(warnings) > 0 {
		// A fleet's partial list: said in the text and the structure.
		for _, w := range warnings {
			result.Content = append(result.Content, &mcp.TextContent{Text: "warning: " + w})
		}
		if m, ok := result.StructuredContent.(map[string]json.RawMessage); ok {
			m["warnings"], _ = json.Marshal(warnings)
		}
	}
	return result
}

// errorResult is the tool result of a failure, "<code>: <message>".
func errorResult(err error) *mcp.CallToolResult {
	return &mcp.CallToolResult{IsError: true, Content: []mcp.Content{&mcp.TextContent{Text: apierr.MCPText(err)}}}
}

// withAuthorization forwards the HTTP request's Authorization header to the
// backends as gRPC metadata.
func withAuthorization(ctx context.Context, req *mcp.CallToolRequest) context.Context {
	if req == nil || req.Extra == nil || req.Extra.Header == nil {
		return ctx
	}
	if v := req.Extra.Header.Get("Authorization"); v != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", v)
	}
	return ctx
}
