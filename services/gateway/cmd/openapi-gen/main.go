// Command openapi-gen merges protoc-gen-openapiv3's per-file documents into
// vm-manager's one OpenAPI 3.1 document, rewritten to the shapes the REST API
// really uses (internal/restjson), which the plugin, following protojson,
// cannot know: REST enum names, 64-bit integers as numbers, snake_case request
// fields, the {"error":{"code","message"}} envelope and 201/204 statuses; and
// to the original vm-manager's layout (shape.go, names.go): its schema names
// and operationIds, named request bodies, the error statuses per operation,
// paths below the /api/v1 server. The required lists are the protos'
// (google.api.field_behavior) = REQUIRED, the keys restjson always writes.
//
//	go run ./services/gateway/cmd/openapi-gen -in build/openapi -out gen/openapi
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"

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
		func() error { walk(doc, numberInt64); walk(doc, plainNumbers); narrowUint32(schemas(doc)); return nil },
		func() error { return snakeRequests(ops) },
		func() error { hideFleetParams(ops); return nil },
		func() error { return errorEnvelope(doc, ops) },
		func() error { return statusCodes(ops) },
		func() error { return errorStatuses(ops) },
		func() error { return hoistRequests(doc, ops) },
		func() error { prune(doc); return nil },
		func() error { plainRefs(doc); return nil },
		func() error { return nullable(doc) },
		func() error { return renameSchemas(doc) },
		func() error { return renameOperations(ops) },
		func() error { return serverPaths(doc) },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return nil, err
		}
	}
	return doc, nil
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
