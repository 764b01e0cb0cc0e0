package main

import (
	"fmt"
	"slices"
	"strings"

	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/sdk/enumname"
)

// operation is one path+method and the RPC behind it.
type operation struct {
	path, method string
	op           obj
	rpc          protoreflect.MethodDescriptor
}

func (o operation) String() string { return strings.ToUpper(o.method) + " " + o.path }

func operations(doc obj) ([]operation, error) {
	services := map[string][]protoreflect.ServiceDescriptor{}
	protoregistry.GlobalFiles.RangeFiles(func(f protoreflect.FileDescriptor) bool {
		for i := 0; i < f.Services().Len(); i++ {
			s := f.Services().Get(i)
			services[string(s.Name())] = append(services[string(s.Name())], s)
		}
		return true
	})
	var ops []operation
	paths := asObj(doc["paths"])
	for _, path := range sortedKeys(paths) {
		item := asObj(paths[path])
		for _, method := range httpMethods {
			op, ok := item[method].(obj)
			if !ok {
				continue
			}
			o := operation{path: path, method: method, op: op}
			// The plugin names operations <Service>_<Method>.
			id, _ := op["operationId"].(string)
			svc, name, ok := strings.Cut(id, "_")
			if !ok {
				return nil, fmt.Errorf("%s: operationId %q is not <Service>_<Method>", o, id)
			}
			if n := len(services[svc]); n != 1 {
				return nil, fmt.Errorf("%s: %d registered services named %s", o, n, svc)
			}
			o.rpc = services[svc][0].Methods().ByName(protoreflect.Name(name))
			if o.rpc == nil {
				return nil, fmt.Errorf("%s: %s has no method %s", o, services[svc][0].FullName(), name)
			}
			ops = append(ops, o)
		}
	}
	return ops, nil
}

func schemas(doc obj) obj { return asObj(asObj(doc["components"])["schemas"]) }

// rewriteEnums gives every proto enum schema the value names restjson
// writes (enumname).
func rewriteEnums(all obj) error {
	for _, name := range sortedKeys(all) {
		s := asObj(all[name])
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(name))
		ed, isEnum := d.(protoreflect.EnumDescriptor)
		_, hasEnum := s["enum"]
		switch {
		case !hasEnum && !isEnum:
			continue
		case !isEnum:
			return fmt.Errorf("schema %s has an enum but is no registered proto enum (%v)", name, err)
		case !hasEnum:
			return fmt.Errorf("schema %s is a proto enum without enum values", name)
		}
		var values []any
		for _, v := range s["enum"].([]any) {
			str, _ := v.(string)
			ev := ed.Values().ByName(protoreflect.Name(str))
			if ev == nil {
				return fmt.Errorf("schema %s: %v is no value of %s", name, v, ed.FullName())
			}
			if ev.Number() == 0 { // never written; omitted means unspecified
				continue
			}
			if rest := enumname.Value(ev); !slices.Contains(values, any(rest)) {
				values = append(values, rest)
			}
		}
		s["enum"] = values
	}
	return nil
}

// numberInt64 types 64-bit integers as JSON numbers, as the codec writes them.
func numberInt64(o obj) {
	if f := o["format"]; o["type"] == "string" && (f == "int64" || f == "uint64") {
		o["type"] = "integer"
	}
}

// plainNumbers drops the formats of 32-bit integers and of floating-point
// numbers, which JSON does not have, as the original's document did: a Go
// client generated from it has int and float32 fields, and code written for
// those must build against ours. 64-bit integers keep int64.
func plainNumbers(o obj) {
	switch f := o["format"]; {
	case o["type"] == "integer" && (f == "int32" || f == "uint32"),
		o["type"] == "number" && (f == "float" || f == "double"):
		delete(o, "format")
	}
}

// narrowUint32 drops the int64 format the plugin gives 32-bit unsigned
// fields (VirtualMachine.cid): they are 32-bit, so plainNumbers' rule
// applies to them too.
func narrowUint32(all obj) {
	for _, name := range sortedKeys(all) {
		d, _ := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(name))
		md, ok := d.(protoreflect.MessageDescriptor)
		if !ok {
			continue
		}
		props := asObj(asObj(all[name])["properties"])
		for i := 0; i < md.Fields().Len(); i++ {
			fd := md.Fields().Get(i)
			if fd.IsMap() {
				fd = fd.MapValue()
			}
			if fd.Kind() != protoreflect.Uint32Kind && fd.Kind() != protoreflect.Fixed32Kind {
				continue
			}
			p := asObj(props[md.Fields().Get(i).JSONName()])
			for _, s := range []obj{p, asObj(p["items"]), asObj(p["additionalProperties"])} {
				if s["type"] == "integer" && s["format"] == "int64" {
					delete(s, "format")
				}
			}
		}
	}
}

// snakeRequests renames body "*" request fields to the proto names the
// contract's requests use.
func snakeRequests(ops []operation) error {
	for _, o := range ops {
		rule, _ := proto.GetExtension(o.rpc.Options(), annotations.E_Http).(*annotations.HttpRule)
		if rule.GetBody() != "*" {
			continue
		}
		content := asObj(asObj(o.op["requestBody"])["content"]) // none when every field is in the path
		for _, ct := range sortedKeys(content) {
			s := asObj(asObj(content[ct])["schema"])
			if _, ok := s["$ref"]; ok || s["type"] != "object" {
				return fmt.Errorf("%s: %s request schema is not an inline object", o, ct)
			}
			if err := snakeObject(s, o.rpc.Input()); err != nil {
				return fmt.Errorf("%s: %w", o, err)
			}
		}
	}
	return nil
}

func snakeObject(s obj, md protoreflect.MessageDescriptor) error {
	rename := map[string]string{}
	props := asObj(s["properties"])
	renamed := obj{}
	for _, k := range sortedKeys(props) {
		fd := md.Fields().ByJSONName(k)
		if fd == nil {
			fd = md.Fields().ByName(protoreflect.Name(k))
		}
		if fd == nil {
			return fmt.Errorf("property %s is no field of %s", k, md.FullName())
		}
		rename[k] = string(fd.Name())
		renamed[string(fd.Name())] = props[k]
	}
	if len(props) > 0 {
		s["properties"] = renamed
	}
	var required []any
	add := func(name string) {
		if !slices.Contains(required, any(name)) {
			required = append(required, name)
		}
	}
	list, _ := s["required"].([]any)
	for _, r := range list {
		name, _ := r.(string)
		if n, ok := rename[name]; ok {
			name = n
		}
		add(name)
	}
	for i := 0; i < md.Fields().Len(); i++ {
		fd := md.Fields().Get(i)
		if _, inBody := renamed[string(fd.Name())]; inBody && isRequired(fd) {
			add(string(fd.Name()))
		}
	}
	if len(required) > 0 {
		s["required"] = required
	}
	return nil
}

func isRequired(fd protoreflect.FieldDescriptor) bool {
	fb, _ := proto.GetExtension(fd.Options(), annotations.E_FieldBehavior).([]annotations.FieldBehavior)
	return slices.Contains(fb, annotations.FieldBehavior_REQUIRED)
}

// errorEnvelope replaces google.rpc.Status, which the gateway never writes,
// with the REST error envelope.
func errorEnvelope(doc obj, ops []operation) error {
	codes := make([]any, len(apierr.Codes))
	names := make([]string, len(apierr.Codes))
	for i, c := range apierr.Codes {
		codes[i], names[i] = string(c), string(c)
	}
	envelope := obj{
		"type":        "object",
		"description": `The error envelope: {"error":{"code":"<code>","message":"<text>"}}.`,
		"required":    []any{"error"},
		"properties": obj{
			"error": obj{
				"type":     "object",
				"required": []any{"code", "message"},
				"properties": obj{
					"code":    obj{"type": "string", "enum": codes, "description": "Machine-readable; stable across REST, gRPC and MCP."},
					"message": obj{"type": "string", "description": "Human-readable."},
				},
			},
		},
	}
	all := schemas(doc)
	if _, ok := all[errorSchema]; ok {
		return fmt.Errorf("the inputs already define a schema named %s", errorSchema)
	}
	all[errorSchema] = envelope
	walk(doc, func(o obj) {
		if o["$ref"] == schemaRef+statusName {
			o["$ref"] = schemaRef + errorSchema
		}
	})
	desc := "An error; code is one of " + strings.Join(names, ", ") + "."
	for _, o := range ops {
		resp := asObj(asObj(o.op["responses"])["default"])
		if resp == nil {
			return fmt.Errorf("%s: no default response", o)
		}
		resp["description"] = desc
		resp["content"] = obj{"application/json": obj{"schema": obj{"$ref": schemaRef + errorSchema}}}
	}
	return nil
}

// statusCodes answers 201 for Create* and 204 without a body for Delete*.
func statusCodes(ops []operation) error {
	for _, o := range ops {
		name := string(o.rpc.Name())
		create, del := strings.HasPrefix(name, "Create"), strings.HasPrefix(name, "Delete")
		if !create && !del {
			continue
		}
		responses := asObj(o.op["responses"])
		ok, found := responses["200"]
		if !found {
			return fmt.Errorf("%s: no 200 response to replace", o)
		}
		delete(responses, "200")
		if create {
			responses["201"] = ok
		} else {
			responses["204"] = obj{"description": "Deleted."}
		}
	}
	return nil
}

// prune drops schemas nothing refers to any more: google.rpc.Status,
// google.protobuf.Any and the Delete*Response bodies a 204 no longer has.
func prune(doc obj) {
	all := schemas(doc)
	seen := map[string]bool{}
	var queue []string
	visit := func(o obj) {
		ref, _ := o["$ref"].(string)
		if name, ok := strings.CutPrefix(ref, schemaRef); ok && !seen[name] {
			seen[name] = true
			queue = append(queue, name)
		}
	}
	for _, k := range sortedKeys(doc) {
		if k != "components" {
			walk(doc[k], visit)
		}
	}
	comps := asObj(doc["components"])
	for _, k := range sortedKeys(comps) {
		if k != "schemas" {
			walk(comps[k], visit)
		}
	}
	for len(queue) > 0 {
		name := queue[0]
		queue = queue[1:]
		walk(all[name], visit)
	}
	for name := range all {
		if !seen[name] {
			delete(all, name)
		}
	}
}
