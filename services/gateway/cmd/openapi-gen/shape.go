package main

import (
	"fmt"
	"strings"

	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// The steps here give the document the original's layout, so that a client
// generated from it has the original's names and types: named request
// schemas, plain $refs, no readOnly, the original's schema names and
// operationIds, and paths below a /api/v1 server.

// apiPrefix is the original's server URL; its paths are relative to it.
const apiPrefix = "/api/v1"

// hoistRequests moves each body "*" request schema into components under
// its message's name (later renamed: CreateVMRequest), as the original
// names its request bodies.
func hoistRequests(doc obj, ops []operation) error {
	all := schemas(doc)
	for _, o := range ops {
		rule, _ := proto.GetExtension(o.rpc.Options(), annotations.E_Http).(*annotations.HttpRule)
		if rule.GetBody() != "*" {
			continue
		}
		content := asObj(asObj(o.op["requestBody"])["content"])
		for _, ct := range sortedKeys(content) {
			media := asObj(content[ct])
			name := string(o.rpc.Input().FullName())
			if _, ok := all[name]; ok {
				return fmt.Errorf("%s: a schema named %s already exists", o, name)
			}
			all[name] = media["schema"]
			media["schema"] = obj{"$ref": schemaRef + name}
		}
	}
	return nil
}

// plainRefs unwraps the plugin's allOf: [{$ref}] around a field's type into
// the $ref itself (its description kept beside it) and drops readOnly: these
// schemas are never request bodies, and a generator such as oapi-codegen
// makes a required readOnly field a pointer, unlike the original's.
func plainRefs(doc obj) {
	walk(doc, func(o obj) {
		if _, ok := o["readOnly"].(bool); ok {
			delete(o, "readOnly")
		}
		list, _ := o["allOf"].([]any)
		if len(list) != 1 {
			return
		}
		ref, ok := asObj(list[0])["$ref"].(string)
		if !ok || len(asObj(list[0])) != 1 {
			return
		}
		delete(o, "allOf")
		o["$ref"] = ref
	})
}

// nullable lets a field marked REQUIRED and declared `optional` be null:
// restjson always writes it, null while unset (the metrics' guest).
func nullable(doc obj) error {
	all := schemas(doc)
	for _, name := range sortedKeys(all) {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(name))
		md, ok := d.(protoreflect.MessageDescriptor)
		if err != nil || !ok {
			continue
		}
		props := asObj(asObj(all[name])["properties"])
		for i := 0; i < md.Fields().Len(); i++ {
			fd := md.Fields().Get(i)
			if !isRequired(fd) || !fd.HasOptionalKeyword() {
				continue
			}
			p := asObj(props[fd.JSONName()])
			if p == nil {
				return fmt.Errorf("schema %s has no property %s", name, fd.JSONName())
			}
			switch ref, isRef := p["$ref"]; {
			case isRef:
				delete(p, "$ref")
				p["oneOf"] = []any{obj{"type": "null"}, obj{"$ref": ref}}
			case p["type"] != nil:
				p["type"] = []any{p["type"], "null"}
			default:
				return fmt.Errorf("schema %s: property %s is neither a $ref nor typed", name, fd.JSONName())
			}
		}
	}
	return nil
}

// renameSchemas names every schema as the original would (schemaName) and
// rewrites the references.
func renameSchemas(doc obj) error {
	all := schemas(doc)
	renamed, from := obj{}, map[string]string{}
	for _, name := range sortedKeys(all) {
		short := name
		if name != errorSchema {
			d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(name))
			if err != nil {
				return fmt.Errorf("schema %s is no registered proto type: %w", name, err)
			}
			short = schemaName(d.FullName())
		}
		if other, dup := from[short]; dup {
			return fmt.Errorf("schemas %s and %s would both be named %s", other, name, short)
		}
		from[short] = name
		renamed[short] = all[name]
	}
	asObj(doc["components"])["schemas"] = renamed
	to := map[string]string{}
	for short, name := range from {
		to[name] = short
	}
	walk(doc, func(o obj) {
		if ref, ok := o["$ref"].(string); ok {
			if name, ok := strings.CutPrefix(ref, schemaRef); ok && to[name] != "" {
				o["$ref"] = schemaRef + to[name]
			}
		}
	})
	return nil
}

// renameOperations gives each operation the original's kind of id.
func renameOperations(ops []operation) error {
	seen := map[string]operation{}
	for _, o := range ops {
		id := operationID(o.rpc)
		if other, dup := seen[id]; dup {
			return fmt.Errorf("%s and %s would both be %s", other, o, id)
		}
		seen[id] = o
		o.op["operationId"] = id
	}
	return nil
}

// serverPaths moves the paths below the original's server URL, /api/v1, and
// adds the document's own two (served by the gateway, not an RPC).
func serverPaths(doc obj) error {
	paths := asObj(doc["paths"])
	rel := obj{}
	for _, p := range sortedKeys(paths) {
		r, ok := strings.CutPrefix(p, apiPrefix)
		if !ok || !strings.HasPrefix(r, "/") {
			return fmt.Errorf("path %s is outside %s", p, apiPrefix)
		}
		rel[r] = paths[p]
	}
	document := func(id, summary, mediaType, typ string) obj {
		return obj{"get": obj{
			"operationId": id,
			"summary":     summary,
			"responses": obj{"200": obj{
				"description": "The OpenAPI document.",
				"content":     obj{mediaType: obj{"schema": obj{"type": typ}}},
			}},
		}}
	}
	for p, item := range map[string]obj{
		"/openapi.yaml": document("getOpenAPI", "This document, as YAML.", "application/yaml", "string"),
		"/openapi.json": document("getOpenAPIJSON", "This document, as JSON.", "application/json", "object"),
	} {
		if rel[p] != nil {
			return fmt.Errorf("path %s is an RPC's", p)
		}
		rel[p] = item
	}
	doc["paths"] = rel
	doc["servers"] = []any{obj{"url": apiPrefix}}
	return nil
}
