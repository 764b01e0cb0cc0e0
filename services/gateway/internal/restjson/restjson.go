// Package restjson is the JSON of vm-manager's REST API: protobuf messages in
// the original vm-manager's shapes, which protojson does not produce.
//
// Differences from protojson, each for compatibility with the contract:
//   - enums are the short lower-case value: STATE_READY is "ready",
//     WAIT_FOR_ATTESTED is "attested" (the prefix named after the enum is
//     dropped); the zero _UNSPECIFIED value is omitted;
//   - 64-bit integers are JSON numbers, not strings;
//   - a field marked (google.api.field_behavior) = REQUIRED is always
//     written, empty or not: these are the keys the original's schema lists
//     as required, and its clients expect them. An unset message or
//     `optional` scalar among them (the metrics' guest before the first
//     upload) is null, and so is an unspecified enum;
//   - other fields: scalars without presence (bools, numbers) are always
//     written, strings only when non-empty, fields declared `optional` and
//     messages only when set; lists and maps are always written ([] and {});
//   - output is indented with two spaces and ends in a newline.
//
// Requests accept both the snake_case proto names (the contract's) and the
// camelCase JSON names, take enums in either form ("" is the unspecified
// value, which the services read as "the default", as the original did),
// and reject unknown fields.
package restjson

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/giantswarm/vm-manager/sdk/enumname"
	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Marshal encodes m in the REST shape.
func Marshal(m proto.Message) ([]byte, error) {
	var buf bytes.Buffer
	if err := writeMessage(&buf, m.ProtoReflect()); err != nil {
		return nil, err
	}
	return indent(buf.Bytes())
}

// indent is the REST layout of compact JSON: two spaces, a final newline.
func indent(compact []byte) ([]byte, error) {
	var out bytes.Buffer
	if err := json.Indent(&out, compact, "", "  "); err != nil {
		return nil, err
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}

func isWellKnown(md protoreflect.MessageDescriptor) bool {
	return md.ParentFile().Package() == "google.protobuf"
}

func writeMessage(buf *bytes.Buffer, m protoreflect.Message) error {
	md := m.Descriptor()
	if isWellKnown(md) {
		if md.FullName() == "google.protobuf.Timestamp" {
			ts := m.Interface().(*timestamppb.Timestamp)
			buf.WriteString(strconv.Quote(ts.AsTime().UTC().Format(time.RFC3339Nano)))
			return nil
		}
		b, err := protojson.Marshal(m.Interface())
		if err != nil {
			return err
		}
		buf.Write(b)
		return nil
	}
	buf.WriteByte('{')
	first := true
	fields := md.Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if !emit(m, fd) {
			continue
		}
		if !first {
			buf.WriteByte(',')
		}
		first = false
		buf.WriteString(strconv.Quote(fd.JSONName()))
		buf.WriteByte(':')
		if isNull(m, fd) {
			buf.WriteString("null")
			continue
		}
		if err := writeField(buf, fd, m.Get(fd)); err != nil {
			return fmt.Errorf("%s: %w", fd.FullName(), err)
		}
	}
	buf.WriteByte('}')
	return nil
}

func emit(m protoreflect.Message, fd protoreflect.FieldDescriptor) bool {
	switch {
	case fd.IsList() || fd.IsMap() || Required(fd):
		return true
	case fd.HasPresence(): // messages, `optional` scalars, oneofs
		return m.Has(fd)
	case fd.Kind() == protoreflect.StringKind || fd.Kind() == protoreflect.BytesKind:
		return m.Has(fd)
	case fd.Kind() == protoreflect.EnumKind:
		return m.Get(fd).Enum() != 0
	default:
		return true
	}
}

// isNull says whether an emitted field has no value to write: a REQUIRED
// field with presence that is unset, or an unspecified enum.
func isNull(m protoreflect.Message, fd protoreflect.FieldDescriptor) bool {
	switch {
	case fd.IsList() || fd.IsMap():
		return false
	case fd.HasPresence():
		return !m.Has(fd)
	case fd.Kind() == protoreflect.EnumKind:
		return m.Get(fd).Enum() == 0
	}
	return false
}

// required caches Required per field: marshaling asks for every field of
// every message written.
var required sync.Map // protoreflect.FieldDescriptor -> bool

// Required says whether fd is marked (google.api.field_behavior) = REQUIRED:
// in a request, the caller must give it; in a response, it is always written.
// The OpenAPI document's required lists come from the same annotation.
func Required(fd protoreflect.FieldDescriptor) bool {
	if v, ok := required.Load(fd); ok {
		return v.(bool)
	}
	fb, _ := proto.GetExtension(fd.Options(), annotations.E_FieldBehavior).([]annotations.FieldBehavior)
	r := slices.Contains(fb, annotations.FieldBehavior_REQUIRED)
	required.Store(fd, r)
	return r
}

func writeField(buf *bytes.Buffer, fd protoreflect.FieldDescriptor, v protoreflect.Value) error {
	switch {
	case fd.IsList():
		l := v.List()
		buf.WriteByte('[')
		for i := 0; i < l.Len(); i++ {
			if i > 0 {
				buf.WriteByte(',')
			}
			if err := writeSingular(buf, fd, l.Get(i)); err != nil {
				return err
			}
		}
		buf.WriteByte(']')
		return nil
	case fd.IsMap():
		mp := v.Map()
		keys := make([]protoreflect.MapKey, 0, mp.Len())
		mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
			keys = append(keys, k)
			return true
		})
		sortMapKeys(keys)
		buf.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				buf.WriteByte(',')
			}
			// strconv.Quote would write Go escapes (\x00), which JSON lacks.
			kb, _ := json.Marshal(k.String())
			buf.Write(kb)
			buf.WriteByte(':')
			if err := writeSingular(buf, fd.MapValue(), mp.Get(k)); err != nil {
				return err
			}
		}
		buf.WriteByte('}')
		return nil
	}
	return writeSingular(buf, fd, v)
}

func writeSingular(buf *bytes.Buffer, fd protoreflect.FieldDescriptor, v protoreflect.Value) error {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		buf.WriteString(strconv.FormatBool(v.Bool()))
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind,
		protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		buf.WriteString(strconv.FormatInt(v.Int(), 10))
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind, protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		buf.WriteString(strconv.FormatUint(v.Uint(), 10))
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		f := v.Float()
		if math.IsNaN(f) || math.IsInf(f, 0) {
			return fmt.Errorf("%v is not representable in JSON", f)
		}
		b, _ := json.Marshal(f)
		buf.Write(b)
	case protoreflect.StringKind:
		b, _ := json.Marshal(v.String())
		buf.Write(b)
	case protoreflect.BytesKind:
		buf.WriteString(strconv.Quote(base64.StdEncoding.EncodeToString(v.Bytes())))
	case protoreflect.EnumKind:
		ev := fd.Enum().Values().ByNumber(v.Enum())
		if ev == nil {
			buf.WriteString(strconv.Itoa(int(v.Enum())))
		} else {
			buf.WriteString(strconv.Quote(enumname.Value(ev)))
		}
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return writeMessage(buf, v.Message())
	default:
		return fmt.Errorf("unsupported kind %v", fd.Kind())
	}
	return nil
}

func sortMapKeys(keys []protoreflect.MapKey) {
	less := func(a, b protoreflect.MapKey) bool {
		switch a.Interface().(type) {
		case int32, int64:
			return a.Int() < b.Int()
		case uint32, uint64:
			return a.Uint() < b.Uint()
		case bool:
			return !a.Bool() && b.Bool()
		default:
			return a.String() < b.String()
		}
	}
	for i := 1; i < len(keys); i++ {
		for j := i; j > 0 && less(keys[j], keys[j-1]); j-- {
			keys[j], keys[j-1] = keys[j-1], keys[j]
		}
	}
}

// Unmarshal decodes a request body into m: unknown fields and invalid UTF-8
// are errors, and enums may be given in their REST form.
func Unmarshal(data []byte, m proto.Message) error {
	// encoding/json would turn invalid UTF-8 into U+FFFD without a word.
	if !utf8.Valid(data) {
		return fmt.Errorf("invalid UTF-8 in the JSON text")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var tree any
	if err := dec.Decode(&tree); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return fmt.Errorf("unexpected data after the JSON value")
	}
	if err := rewriteEnums(tree, m.ProtoReflect().Descriptor()); err != nil {
		return err
	}
	norm, err := json.Marshal(tree)
	if err != nil {
		return err
	}
	return protojson.UnmarshalOptions{DiscardUnknown: false}.Unmarshal(norm, m)
}

// rewriteEnums replaces REST enum names with the full value names, in place.
func rewriteEnums(node any, md protoreflect.MessageDescriptor) error {
	obj, ok := node.(map[string]any)
	if !ok || isWellKnown(md) {
		return nil
	}
	for key, val := range obj {
		fd := md.Fields().ByJSONName(key)
		if fd == nil {
			fd = md.Fields().ByTextName(key)
		}
		if fd == nil {
			continue // protojson reports it as unknown
		}
		target := fd
		if fd.IsMap() {
			target = fd.MapValue()
		}
		switch {
		case target.Kind() == protoreflect.EnumKind:
			fix := func(v any) (any, error) { return enumFromREST(target.Enum(), v) }
			if err := mapValues(obj, key, val, fd, fix); err != nil {
				return fmt.Errorf("field %q: %w", key, err)
			}
		case target.Kind() == protoreflect.MessageKind:
			fix := func(v any) (any, error) { return v, rewriteEnums(v, target.Message()) }
			if err := mapValues(obj, key, val, fd, fix); err != nil {
				return err
			}
		}
	}
	return nil
}

// mapValues replaces the value of obj[key] (each element of a list, each
// value of a map) with what fix makes of it. A list or map field whose JSON
// is not an array or object is left for protojson to reject.
func mapValues(obj map[string]any, key string, val any, fd protoreflect.FieldDescriptor, fix func(any) (any, error)) (err error) {
	switch {
	case fd.IsList():
		list, _ := val.([]any)
		for i, v := range list {
			if list[i], err = fix(v); err != nil {
				return err
			}
		}
	case fd.IsMap():
		m, _ := val.(map[string]any)
		for k, v := range m {
			if m[k], err = fix(v); err != nil {
				return err
			}
		}
	default:
		obj[key], err = fix(val)
	}
	return err
}

func enumFromREST(ed protoreflect.EnumDescriptor, v any) (any, error) {
	s, ok := v.(string)
	if !ok {
		return v, nil
	}
	if s == "" { // the original's "use the default"
		return string(ed.Values().ByNumber(0).Name()), nil
	}
	if ed.Values().ByName(protoreflect.Name(s)) != nil {
		return s, nil
	}
	values := ed.Values()
	var names []string
	for i := 0; i < values.Len(); i++ {
		ev := values.Get(i)
		if ev.Number() == 0 {
			continue
		}
		rest := enumname.Value(ev)
		if rest == s {
			return string(ev.Name()), nil
		}
		names = append(names, rest)
	}
	return nil, fmt.Errorf("%q is not one of %s", s, strings.Join(names, ", "))
}

// Marshaler plugs the codec into grpc-gateway.
type Marshaler struct{}

var _ runtime.Marshaler = Marshaler{}

// ContentType is always JSON.
func (Marshaler) ContentType(any) string { return "application/json" }

// Marshal encodes a proto message, or a slice of them (a response_body
// that is a repeated field, always an array, never null); anything else goes
// through encoding/json.
func (Marshaler) Marshal(v any) ([]byte, error) {
	if m, ok := v.(proto.Message); ok {
		return Marshal(m)
	}
	if rv := reflect.ValueOf(v); rv.Kind() == reflect.Slice && rv.Type().Elem().Implements(protoMessageType) {
		var buf bytes.Buffer
		buf.WriteByte('[')
		for i := 0; i < rv.Len(); i++ {
			if i > 0 {
				buf.WriteByte(',')
			}
			if err := writeMessage(&buf, rv.Index(i).Interface().(proto.Message).ProtoReflect()); err != nil {
				return nil, err
			}
		}
		buf.WriteByte(']')
		return indent(buf.Bytes())
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

var protoMessageType = reflect.TypeFor[proto.Message]()

// Unmarshal decodes into a proto message.
func (Marshaler) Unmarshal(data []byte, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return json.Unmarshal(data, v)
	}
	return Unmarshal(data, m)
}

// NewDecoder reads the whole body; an empty body is io.EOF, which
// grpc-gateway treats as "no fields".
func (Marshaler) NewDecoder(r io.Reader) runtime.Decoder {
	return runtime.DecoderFunc(func(v any) error {
		data, err := io.ReadAll(r)
		if err != nil {
			return fmt.Errorf("body: %w", err)
		}
		if len(bytes.TrimSpace(data)) == 0 {
			return io.EOF
		}
		if err := (Marshaler{}).Unmarshal(data, v); err != nil {
			return fmt.Errorf("body: %w", err)
		}
		return nil
	})
}

// NewEncoder writes one value.
func (Marshaler) NewEncoder(w io.Writer) runtime.Encoder {
	return runtime.EncoderFunc(func(v any) error {
		b, err := Marshaler{}.Marshal(v)
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	})
}
