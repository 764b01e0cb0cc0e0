// Command openapi-gen merges protoc-gen-openapiv3's per-file documents into
// vm-manager's one OpenAPI 3.1 document, rewritten to the shapes the REST API
// really uses (internal/restjson), which the plugin, following protojson,
// cannot know: REST enum names, 64-bit integers as numbers, snake_case request
// fields, the {"error":{"code","message"}} envelope and 201/204 statuses.
//
//	go run ./services/gateway/cmd/openapi-gen -in build/openapi -out gen/openapi
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"

	"go.yaml.in/yaml/v3"
	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/giantswarm/vm-manager/gen/apierr"
	"github.com/giantswarm/vm-manager/gen/enumname"

	// Registers the descriptors the rewrites resolve by name.
	_ "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	_ "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

const (
	jsonName = "vmmanager.openapi.json"
	yamlName = "vmmanager.openapi.yaml"

	schemaRef   = "#/components/schemas/"
	statusName  = "google.rpc.Status"
	anyName     = "google.protobuf.Any"
	errorSchema = "Error"
)

const description = "Per-host VM provisioning: vm-manager runs QEMU virtual machines, each " +
	"with its own vTPM, serves them an instance metadata service (IMDS) and " +
	"releases their user-data only after TPM attestation of the boot. " +
	`Every error is {"error":{"code":"<code>","message":"<text>"}}, ` +
	"with the codes listed in the Error schema. Request body fields are " +
	"snake_case; response fields are camelCase, except the metrics summary " +
	"(GET /api/v1/vms/{id}/metrics), which keeps the original's snake_case keys."

var httpMethods = []string{"get", "put", "post", "delete", "options", "head", "patch", "trace"}

type obj = map[string]any

func main() {
	in := flag.String("in", "build/openapi", "directory of protoc-gen-openapiv3 output (*.json)")
	out := flag.String("out", "gen/openapi", "directory to write "+jsonName+" and "+yamlName+" to")
	flag.Parse()
	if err := run(*in, *out); err != nil {
		fmt.Fprintln(os.Stderr, "openapi-gen:", err)
		os.Exit(1)
	}
}

func run(in, out string) error {
	doc, err := build(in)
	if err != nil {
		return err
	}
	js, ym, err := render(doc)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(out, jsonName), js, 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(out, yamlName), ym, 0o644)
}

// build reads, merges and rewrites every document under dir.
func build(dir string) (obj, error) {
	files, err := inputs(dir)
	if err != nil {
		return nil, err
	}
	doc := obj{
		"openapi": "3.1.0",
		"info": obj{
			"title":       "vm-manager",
			"version":     "v1",
			"description": description,
		},
		"paths":      obj{},
		"components": obj{"schemas": obj{}},
		"tags":       []any{},
	}
	for _, f := range files {
		src, err := readJSON(f)
		if err != nil {
			return nil, err
		}
		if err := merge(doc, src); err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
	}
	ops, err := operations(doc)
	if err != nil {
		return nil, err
	}
	steps := []func() error{
		func() error { return rewriteEnums(schemas(doc)) },
		func() error { walk(doc, numberInt64); return nil },
		func() error { return snakeRequests(ops) },
		func() error { return errorEnvelope(doc, ops) },
		func() error { return statusCodes(ops) },
		func() error { prune(doc); return nil },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return nil, err
		}
	}
	return doc, nil
}

func inputs(dir string) ([]string, error) {
	var files []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".json") {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no *.json under %s", dir)
	}
	sort.Strings(files)
	return files, nil
}

func readJSON(name string) (obj, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber() // numbers pass through unchanged
	var doc obj
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if v, _ := doc["openapi"].(string); !strings.HasPrefix(v, "3.1.") {
		return nil, fmt.Errorf("%s: openapi %q, want 3.1.x", name, v)
	}
	return doc, nil
}

func merge(dst, src obj) error {
	for _, k := range sortedKeys(src) {
		v := src[k]
		switch k {
		case "openapi", "info": // replaced by vm-manager's own
		case "paths":
			if err := mergePaths(dst["paths"].(obj), asObj(v)); err != nil {
				return err
			}
		case "components":
			comps := dst["components"].(obj)
			for _, section := range sortedKeys(asObj(v)) {
				if comps[section] == nil {
					comps[section] = obj{}
				}
				if err := union(asObj(comps[section]), asObj(asObj(v)[section]), "components."+section); err != nil {
					return err
				}
			}
		case "tags":
			tags, err := mergeTags(dst["tags"].([]any), v)
			if err != nil {
				return err
			}
			dst["tags"] = tags
		default:
			if old, ok := dst[k]; ok && !reflect.DeepEqual(old, v) {
				return fmt.Errorf("%s differs between inputs", k)
			}
			dst[k] = v
		}
	}
	return nil
}

func mergePaths(dst, src obj) error {
	for _, path := range sortedKeys(src) {
		item := asObj(src[path])
		if dst[path] == nil {
			dst[path] = obj{}
		}
		have := asObj(dst[path])
		for _, k := range sortedKeys(item) {
			old, ok := have[k]
			switch {
			case !ok:
				have[k] = item[k]
			case slices.Contains(httpMethods, k):
				return fmt.Errorf("%s %s is defined twice", strings.ToUpper(k), path)
			case !reflect.DeepEqual(old, item[k]):
				return fmt.Errorf("path %s: %s differs between inputs", path, k)
			}
		}
	}
	return nil
}

// union adds src's entries to dst; the same name must mean the same thing.
func union(dst, src obj, what string) error {
	for _, name := range sortedKeys(src) {
		if old, ok := dst[name]; ok && !reflect.DeepEqual(old, src[name]) {
			return fmt.Errorf("%s: conflicting definitions of %s", what, name)
		}
		dst[name] = src[name]
	}
	return nil
}

func mergeTags(dst []any, src any) ([]any, error) {
	list, _ := src.([]any)
	for _, t := range list {
		name := asObj(t)["name"]
		dup := false
		for _, have := range dst {
			if asObj(have)["name"] == name {
				if !reflect.DeepEqual(have, t) {
					return nil, fmt.Errorf("tag %v differs between inputs", name)
				}
				dup = true
			}
		}
		if !dup {
			dst = append(dst, t)
		}
	}
	return dst, nil
}

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

// walk calls fn on every object in v, depth first.
func walk(v any, fn func(obj)) {
	switch v := v.(type) {
	case obj:
		fn(v)
		for _, k := range sortedKeys(v) {
			walk(v[k], fn)
		}
	case []any:
		for _, e := range v {
			walk(e, fn)
		}
	}
}

func asObj(v any) obj {
	o, _ := v.(obj)
	return o
}

func sortedKeys(o obj) []string {
	keys := make([]string, 0, len(o))
	for k := range o {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// render encodes doc as indented JSON and as YAML, both with sorted keys.
func render(doc obj) (js, ym []byte, err error) {
	var jb bytes.Buffer
	enc := json.NewEncoder(&jb)
	enc.SetEscapeHTML(false) // descriptions hold <id>_<version>
	enc.SetIndent("", "  ")
	if err := enc.Encode(doc); err != nil {
		return nil, nil, err
	}
	node, err := yamlNode(doc)
	if err != nil {
		return nil, nil, err
	}
	var yb bytes.Buffer
	ye := yaml.NewEncoder(&yb)
	ye.SetIndent(2)
	if err := ye.Encode(node); err != nil {
		return nil, nil, err
	}
	if err := ye.Close(); err != nil {
		return nil, nil, err
	}
	return jb.Bytes(), yb.Bytes(), nil
}

// yamlNode builds the YAML tree by hand so keys keep JSON's order and
// strings such as "200" stay strings.
func yamlNode(v any) (*yaml.Node, error) {
	scalar := func(tag, value string) *yaml.Node {
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: tag, Value: value}
	}
	switch v := v.(type) {
	case obj:
		n := &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
		for _, k := range sortedKeys(v) {
			val, err := yamlNode(v[k])
			if err != nil {
				return nil, err
			}
			n.Content = append(n.Content, scalar("!!str", k), val)
		}
		return n, nil
	case []any:
		n := &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
		for _, e := range v {
			val, err := yamlNode(e)
			if err != nil {
				return nil, err
			}
			n.Content = append(n.Content, val)
		}
		return n, nil
	case string:
		return scalar("!!str", v), nil
	case bool:
		if v {
			return scalar("!!bool", "true"), nil
		}
		return scalar("!!bool", "false"), nil
	case json.Number:
		if _, err := v.Int64(); err == nil {
			return scalar("!!int", v.String()), nil
		}
		return scalar("!!float", v.String()), nil
	case nil:
		return scalar("!!null", "null"), nil
	default:
		return nil, fmt.Errorf("unexpected JSON value of type %T", v)
	}
}
