package mcp

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"
)

// everyBackend is a gRPC server for both services that answers every call
// with its response message, every field set (full) or none: the two
// extremes of what restjson writes for it.
func everyBackend(t *testing.T, full bool) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer(grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
		name, _ := grpc.MethodFromServerStream(stream)
		md, err := methodOf(name)
		if err != nil {
			return err
		}
		if err := stream.RecvMsg(dynamicpb.NewMessage(md.Input())); err != nil {
			return err
		}
		mt, err := protoregistry.GlobalTypes.FindMessageByName(md.Output().FullName())
		if err != nil {
			return err
		}
		resp := mt.New()
		if full {
			populate(resp, 0)
		}
		return stream.SendMsg(resp.Interface())
	}))
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// methodOf finds "/pkg.Service/Method" among the registered files.
func methodOf(full string) (protoreflect.MethodDescriptor, error) {
	i := len(full) - 1
	for i >= 0 && full[i] != '/' {
		i--
	}
	if i <= 0 {
		return nil, fmt.Errorf("bad method %q", full)
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(full[1:i]))
	if err != nil {
		return nil, err
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return nil, fmt.Errorf("%s is not a service", full[1:i])
	}
	md := sd.Methods().ByName(protoreflect.Name(full[i+1:]))
	if md == nil {
		return nil, fmt.Errorf("no method %q", full)
	}
	return md, nil
}

// populate sets every field of m (the first of each oneof): lists and maps
// get two entries, enums their last value.
func populate(m protoreflect.Message, depth int) {
	if depth > 8 {
		return
	}
	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if od := fd.ContainingOneof(); od != nil && !od.IsSynthetic() && od.Fields().Get(0) != fd {
			continue
		}
		switch {
		case fd.IsList():
			l := m.Mutable(fd).List()
			for range 2 {
				if fd.Message() != nil {
					e := l.NewElement()
					populate(e.Message(), depth+1)
					l.Append(e)
				} else {
					l.Append(scalar(fd))
				}
			}
		case fd.IsMap():
			mp := m.Mutable(fd).Map()
			for k := range 2 {
				key := mapKey(fd.MapKey(), k)
				if fd.MapValue().Message() != nil {
					v := mp.NewValue()
					populate(v.Message(), depth+1)
					mp.Set(key, v)
				} else {
					mp.Set(key, scalar(fd.MapValue()))
				}
			}
		case fd.Message() != nil:
			populate(m.Mutable(fd).Message(), depth+1)
		default:
			m.Set(fd, scalar(fd))
		}
	}
}

func mapKey(fd protoreflect.FieldDescriptor, k int) protoreflect.MapKey {
	switch fd.Kind() {
	case protoreflect.StringKind:
		return protoreflect.ValueOfString(fmt.Sprint("k", k)).MapKey()
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(k == 1).MapKey()
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(int32(k)).MapKey()
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(int64(k)).MapKey()
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(uint32(k)).MapKey()
	}
	return protoreflect.ValueOfUint64(uint64(k)).MapKey()
}

func scalar(fd protoreflect.FieldDescriptor) protoreflect.Value {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(7)
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(7)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(7)
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(7)
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(1.5)
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(1.5)
	case protoreflect.StringKind:
		return protoreflect.ValueOfString("s")
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte("b"))
	case protoreflect.EnumKind:
		vals := fd.Enum().Values()
		return protoreflect.ValueOfEnum(vals.Get(vals.Len() - 1).Number())
	}
	panic(fmt.Sprintf("no scalar for %v", fd.Kind()))
}

// validArgs are arguments every tool accepts.
var validArgs = map[string]map[string]any{
	"get_image":          {"ref": "img"},
	"get_network":        {"name": "n"},
	"get_vm":             {"id": "0a1b2c3d"},
	"get_vm_console":     {"id": "0a1b2c3d"},
	"get_vm_metrics":     {"id": "0a1b2c3d"},
	"get_vm_attestation": {"id": "0a1b2c3d"},
	"create_network":     {"name": "n", "cidr": "10.0.0.0/24"},
	"delete_network":     {"name": "n"},
	"create_vm":          {"name": "v"},
	"start_vm":           {"id": "0a1b2c3d"},
	"stop_vm":            {"id": "0a1b2c3d"},
	"reboot_vm":          {"id": "0a1b2c3d"},
	"delete_vm":          {"id": "0a1b2c3d"},
	"exec_vm":            {"id": "0a1b2c3d", "command": []string{"true"}},
	"forward_port":       {"id": "0a1b2c3d", "port": 22},
	"update_vm_lifetime": {"id": "0a1b2c3d", "ttl": "1h"},
	"suspend_vm":         {"id": "0a1b2c3d"},
	"resume_vm":          {"id": "0a1b2c3d"},
	"import_image":       {"source": "localhost:5000/python:3.12"},
	"get_pool":           {"name": "p"},
	"create_pool":        {"name": "p", "size": 1},
	"resize_pool":        {"name": "p", "size": 2},
	"delete_pool":        {"name": "p"},
	"fork_vm":            {"id": "0a1b2c3d"},
}

// connect is an MCP SDK client session with h.
func connect(t *testing.T, h http.Handler) *mcp.ClientSession {
	t.Helper()
	ts := httptest.NewServer(h)
	t.Cleanup(ts.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(ctx, &mcp.StreamableClientTransport{Endpoint: ts.URL}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	return cs
}

// resolveOutput is a tool's outputSchema as the client got it, ready to
// validate with.
func resolveOutput(t *testing.T, tool *mcp.Tool) *jsonschema.Resolved {
	t.Helper()
	if tool.OutputSchema == nil {
		t.Fatalf("%s has no outputSchema", tool.Name)
	}
	b, _ := json.Marshal(tool.OutputSchema)
	var s jsonschema.Schema
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatalf("%s: outputSchema: %v", tool.Name, err)
	}
	if s.Type != "object" {
		t.Errorf("%s: outputSchema type %q, want object", tool.Name, s.Type)
	}
	r, err := s.Resolve(nil)
	if err != nil {
		t.Fatalf("%s: outputSchema: %v", tool.Name, err)
	}
	return r
}

// TestStructuredOutput: every tool has an outputSchema, and the
// structuredContent of its result is the text content's JSON (a list under
// its name) and validates against it, for responses with every field set
// and with none.
func TestStructuredOutput(t *testing.T) {
	for _, full := range []bool{true, false} {
		t.Run(map[bool]string{true: "every field", false: "no field"}[full], func(t *testing.T) {
			conn := everyBackend(t, full)
			cs := connect(t, New(hypervisorv1.NewHypervisorServiceClient(conn), attestationv1.NewAttestationServiceClient(conn), nil, nil))
			ctx := context.Background()
			lt, err := cs.ListTools(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(lt.Tools) != len(ToolNames) {
				t.Fatalf("%d tools", len(lt.Tools))
			}
			for _, tool := range lt.Tools {
				schema := resolveOutput(t, tool)
				res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool.Name, Arguments: validArgs[tool.Name]})
				if err != nil {
					t.Fatalf("%s: %v", tool.Name, err)
				}
				if tool.Name == "import_image" && !full {
					// A stream that ends without its DONE message is
					// an error, not an empty image.
					wantError(t, res, "internal_error: ")
					continue
				}
				// A fleet's partial list adds a "warning: " text per node
				// that did not answer, and "warnings" to the structure.
				var warnings []any
				for _, c := range res.Content[min(1, len(res.Content)):] {
					w, _ := strings.CutPrefix(c.(*mcp.TextContent).Text, "warning: ")
					warnings = append(warnings, w)
				}
				res.Content = res.Content[:min(1, len(res.Content))]
				body := wantOK(t, res)
				var fromText any
				if err := json.Unmarshal([]byte(body), &fromText); err != nil {
					t.Fatalf("%s: text: %v", tool.Name, err)
				}
				if l, ok := fromText.([]any); ok {
					key := map[string]string{"list_images": "images", "list_networks": "networks", "list_vms": "vms", "list_pools": "pools"}[tool.Name]
					if key == "" {
						t.Fatalf("%s: a list", tool.Name)
					}
					if full && len(l) != 2 {
						t.Errorf("%s: %d items", tool.Name, len(l))
					}
					fromText = map[string]any{key: l}
					if full != (len(warnings) > 0) {
						t.Errorf("%s: warnings %v", tool.Name, warnings)
					}
					if len(warnings) > 0 {
						fromText.(map[string]any)["warnings"] = warnings
					}
				}
				if !reflect.DeepEqual(res.StructuredContent, fromText) {
					t.Errorf("%s: structuredContent\n%s\nis not the text\n%s", tool.Name, mustJSON(res.StructuredContent), body)
				}
				if err := schema.Validate(res.StructuredContent); err != nil {
					t.Errorf("%s: structuredContent does not validate: %v\n%s", tool.Name, err, body)
				}
			}
		})
	}
}

// TestOutputSchemaRejects: the output schemas are not "anything goes": a
// wrong type, a missing always-written field or a value out of an enum is
// refused.
func TestOutputSchemaRejects(t *testing.T) {
	conn := everyBackend(t, true)
	cs := connect(t, New(hypervisorv1.NewHypervisorServiceClient(conn), attestationv1.NewAttestationServiceClient(conn), nil, nil))
	lt, err := cs.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	schemas := map[string]*jsonschema.Resolved{}
	for _, tool := range lt.Tools {
		schemas[tool.Name] = resolveOutput(t, tool)
	}
	for _, c := range []struct {
		tool string
		v    string
	}{
		{"get_host", `{"cpus": "8"}`},
		{"get_host", `{"hostname": "h"}`}, // no cpus, ready, missing, …
		{"get_vm", `{"state": "sleeping"}`},
		{"delete_network", `{"name": "n", "deleted": true}`},
		{"list_vms", `[]`},
		{"list_vms", `{"vms": [{"cpus": true}]}`},
		{"exec_vm", `{"stdout": "", "stderr": "", "exitCode": 1.5, "truncated": false}`},
	} {
		var v any
		if err := json.Unmarshal([]byte(c.v), &v); err != nil {
			t.Fatal(err)
		}
		if err := schemas[c.tool].Validate(v); err == nil {
			t.Errorf("%s: %s validates", c.tool, c.v)
		}
	}
}
