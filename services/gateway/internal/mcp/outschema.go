package mcp

import (
	"encoding/json"
	"fmt"
	"reflect"

	"github.com/giantswarm/vm-manager/sdk/enumname"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"github.com/google/jsonschema-go/jsonschema"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// output is what a tool's result looks like: its outputSchema, and for a
// list tool the key its structuredContent holds the list under. MCP wants
// an object there, while the text content is the bare array (the REST body).
type output struct {
	schema *jsonschema.Schema
	key    string
}

// structured is a result's structuredContent: the REST body, or for a list
// {key: body}.
func (o output) structured(body []byte) any {
	if o.key == "" {
		return json.RawMessage(body)
	}
	return map[string]json.RawMessage{o.key: body}
}

// listed is a list tool's result: the items, and a fleet gateway's
// warnings when some nodes did not answer (the result then says so in its
// text and in structuredContent's "warnings": never a silent gap).
type listed struct {
	items    any
	warnings []string
}

// outputOf is the output of a tool whose result is an Out: a proto message
// (the schema of what restjson writes for it) or a plain Go value
// (jsonschema.For, as encoding/json writes it).
func outputOf[Out any]() (output, error) {
	var zero Out
	if m, ok := any(zero).(proto.Message); ok {
		return output{schema: messageSchema(m.ProtoReflect().Descriptor(), nil)}, nil
	}
	s, err := jsonschema.For[Out](nil)
	if err != nil {
		return output{}, err
	}
	if s.Type != "object" {
		return output{}, fmt.Errorf("%s: a result must be an object", reflect.TypeFor[Out]())
	}
	return output{schema: s}, nil
}

// listOutput is the output of a list tool: the response message's only
// repeated field, under its JSON name ({"vms": [...]}).
func listOutput(resp protoreflect.MessageDescriptor) (output, error) {
	var list protoreflect.FieldDescriptor
	fields := resp.Fields()
	for i := 0; i < fields.Len(); i++ {
		if fd := fields.Get(i); fd.IsList() {
			if fd.Name() == "warnings" { // a fleet's partial list (listed)
				continue
			}
			if list != nil {
				return output{}, fmt.Errorf("%s has more than one list", resp.FullName())
			}
			list = fd
		}
	}
	if list == nil {
		return output{}, fmt.Errorf("%s has no list", resp.FullName())
	}
	key := list.JSONName()
	props := map[string]*jsonschema.Schema{key: fieldSchema(list, nil)}
	order := []string{key}
	if w := fields.ByName("warnings"); w != nil {
		props["warnings"] = fieldSchema(w, nil)
		props["warnings"].Description = "a fleet gateway's nodes that did not answer: the list is partial"
		order = append(order, "warnings")
	}
	return output{key: key, schema: &jsonschema.Schema{
		Type:          "object",
		Properties:    props,
		PropertyOrder: order,
		Required:      []string{key},
	}}, nil
}

// messageSchema is the JSON schema of what restjson writes for a message of
// type md (see its package comment): every field under its JSON name; lists,
// maps and scalars without presence other than strings and enums are always
// written (required); strings, enums, `optional` scalars and messages only
// when set. A message field may also be null, for a surface that writes an
// unset message as null rather than leaving it out. seen breaks recursion.
func messageSchema(md protoreflect.MessageDescriptor, seen map[protoreflect.FullName]bool) *jsonschema.Schema {
	if isWellKnown(md) {
		return wellKnownSchema(md)
	}
	if seen[md.FullName()] {
		return &jsonschema.Schema{} // a recursive message: anything
	}
	seen = cloneSeen(seen)
	seen[md.FullName()] = true
	s := &jsonschema.Schema{Type: "object", Properties: map[string]*jsonschema.Schema{}}
	fields := md.Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		name := fd.JSONName()
		s.Properties[name] = fieldSchema(fd, seen)
		s.PropertyOrder = append(s.PropertyOrder, name)
		if alwaysWritten(fd) {
			s.Required = append(s.Required, name)
		}
	}
	return s
}

func cloneSeen(seen map[protoreflect.FullName]bool) map[protoreflect.FullName]bool {
	c := make(map[protoreflect.FullName]bool, len(seen)+1)
	for k, v := range seen {
		c[k] = v
	}
	return c
}

// alwaysWritten mirrors restjson's rule (restjson.emit) for fields it
// writes even when they are empty: lists, maps, REQUIRED fields and scalars
// without presence.
func alwaysWritten(fd protoreflect.FieldDescriptor) bool {
	switch {
	case fd.IsList() || fd.IsMap() || restjson.Required(fd):
		return true
	case fd.HasPresence():
		return false
	}
	switch fd.Kind() {
	case protoreflect.StringKind, protoreflect.BytesKind, protoreflect.EnumKind:
		return false
	}
	return true
}

func fieldSchema(fd protoreflect.FieldDescriptor, seen map[protoreflect.FullName]bool) *jsonschema.Schema {
	switch {
	case fd.IsList():
		return &jsonschema.Schema{Type: "array", Items: singularSchema(fd, seen, false)}
	case fd.IsMap():
		return &jsonschema.Schema{Type: "object", AdditionalProperties: singularSchema(fd.MapValue(), seen, false)}
	}
	return singularSchema(fd, seen, true)
}

// singularSchema is one value of fd; field says it is a message field of
// its own (not a list element or map value), which may be null.
func singularSchema(fd protoreflect.FieldDescriptor, seen map[protoreflect.FullName]bool, field bool) *jsonschema.Schema {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return &jsonschema.Schema{Type: "boolean"}
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind,
		protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return &jsonschema.Schema{Type: "integer"}
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind, protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		zero := 0.0
		return &jsonschema.Schema{Type: "integer", Minimum: &zero}
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		return &jsonschema.Schema{Type: "number"}
	case protoreflect.StringKind:
		return &jsonschema.Schema{Type: "string"}
	case protoreflect.BytesKind:
		return &jsonschema.Schema{Type: "string", ContentEncoding: "base64"}
	case protoreflect.EnumKind:
		s := &jsonschema.Schema{Type: "string"}
		values := fd.Enum().Values()
		for i := 0; i < values.Len(); i++ {
			if ev := values.Get(i); ev.Number() != 0 {
				s.Enum = append(s.Enum, enumname.Value(ev))
			}
		}
		if field && restjson.Required(fd) {
			// restjson writes a REQUIRED enum that is unspecified as null.
			s = nullable(s)
			s.Enum = append(s.Enum, nil)
		}
		return s
	case protoreflect.MessageKind, protoreflect.GroupKind:
		s := messageSchema(fd.Message(), seen)
		if field {
			s = nullable(s)
		}
		return s
	}
	return &jsonschema.Schema{}
}

// nullable lets s be null too.
func nullable(s *jsonschema.Schema) *jsonschema.Schema {
	switch {
	case s.Type != "":
		s.Types, s.Type = []string{s.Type, "null"}, ""
	case len(s.Types) > 0:
		s.Types = append(s.Types, "null")
	}
	return s // no type (anything) takes null already
}

func isWellKnown(md protoreflect.MessageDescriptor) bool {
	return md.ParentFile().Package() == "google.protobuf"
}

// wellKnownSchema is how restjson writes the well-known types: Timestamp as
// RFC 3339, the others as protojson does.
func wellKnownSchema(md protoreflect.MessageDescriptor) *jsonschema.Schema {
	switch md.FullName() {
	case "google.protobuf.Timestamp":
		return &jsonschema.Schema{Type: "string", Format: "date-time"}
	case "google.protobuf.Duration", "google.protobuf.FieldMask":
		return &jsonschema.Schema{Type: "string"}
	case "google.protobuf.Struct", "google.protobuf.Empty":
		return &jsonschema.Schema{Type: "object"}
	case "google.protobuf.ListValue":
		return &jsonschema.Schema{Type: "array"}
	case "google.protobuf.BoolValue":
		return &jsonschema.Schema{Type: "boolean"}
	case "google.protobuf.StringValue", "google.protobuf.BytesValue",
		"google.protobuf.Int64Value", "google.protobuf.UInt64Value": // 64-bit wrappers are strings in protojson
		return &jsonschema.Schema{Type: "string"}
	case "google.protobuf.Int32Value", "google.protobuf.UInt32Value":
		return &jsonschema.Schema{Type: "integer"}
	case "google.protobuf.FloatValue", "google.protobuf.DoubleValue":
		return &jsonschema.Schema{Type: "number"}
	}
	return &jsonschema.Schema{} // Value, Any: any JSON
}
