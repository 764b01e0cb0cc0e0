package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// testdata/openapi is a copy of build/openapi as `buf generate` writes it.
const testInput = "testdata/openapi"

func generate(t *testing.T) (js, ym []byte) {
	t.Helper()
	out := t.TempDir()
	if err := run(testInput, out); err != nil {
		t.Fatal(err)
	}
	js, err := os.ReadFile(filepath.Join(out, jsonName))
	if err != nil {
		t.Fatal(err)
	}
	ym, err = os.ReadFile(filepath.Join(out, yamlName))
	if err != nil {
		t.Fatal(err)
	}
	return js, ym
}

// get follows a path of object keys through a decoded JSON document.
func get(t *testing.T, v any, keys ...string) any {
	t.Helper()
	for i, k := range keys {
		m, ok := v.(map[string]any)
		if !ok {
			t.Fatalf("%s is not an object", strings.Join(keys[:i], "."))
		}
		if v, ok = m[k]; !ok {
			t.Fatalf("%s is missing", strings.Join(keys[:i+1], "."))
		}
	}
	return v
}

func has(v any, key string) bool {
	_, ok := v.(map[string]any)[key]
	return ok
}

func TestGenerate(t *testing.T) {
	js, ym := generate(t)
	var doc map[string]any
	if err := json.Unmarshal(js, &doc); err != nil {
		t.Fatal(err)
	}
	if doc["openapi"] != "3.1.0" {
		t.Errorf("openapi = %v", doc["openapi"])
	}
	if title := get(t, doc, "info", "title"); title != "vm-manager" {
		t.Errorf("info.title = %v", title)
	}

	t.Run("enum", func(t *testing.T) {
		enum := get(t, doc, "components", "schemas", "State", "enum").([]any)
		if !slices.Contains(enum, any("ready")) || slices.Contains(enum, any("STATE_READY")) {
			t.Errorf("State enum = %v, want REST names", enum)
		}
		for _, v := range enum {
			if strings.Contains(strings.ToLower(v.(string)), "unspecified") {
				t.Errorf("State enum lists %v", v)
			}
		}
	})

	t.Run("int64", func(t *testing.T) {
		mem := get(t, doc, "components", "schemas", "Host", "properties", "memoryBytes")
		if typ := get(t, mem, "type"); typ != "integer" {
			t.Errorf("Host.memoryBytes type = %v, want integer", typ)
		}
		walk(doc, func(o obj) {
			if f := o["format"]; (f == "int64" || f == "uint64") && o["type"] != "integer" {
				t.Errorf("64-bit schema of type %v: %v", o["type"], o)
			}
		})
	})

	t.Run("request", func(t *testing.T) {
		if ref := get(t, doc, "paths", "/vms", "post", "requestBody", "content", "application/json", "schema", "$ref"); ref != schemaRef+"CreateVMRequest" {
			t.Errorf("POST /vms body = %v, want the CreateVMRequest schema", ref)
		}
		schema := get(t, doc, "components", "schemas", "CreateVMRequest")
		props := get(t, schema, "properties")
		for _, k := range []string{"memory_mib", "wait_for", "ssh_authorized_keys"} {
			if !has(props, k) {
				t.Errorf("CreateVirtualMachine body lacks %s", k)
			}
		}
		if has(props, "memoryMib") {
			t.Error("CreateVirtualMachine body still has memoryMib")
		}
		if req := get(t, schema, "required").([]any); !slices.Equal(req, []any{"name"}) {
			t.Errorf("CreateVirtualMachine required = %v", req)
		}
		golden := get(t, doc, "components", "schemas", "RecordGoldenRequest")
		if req := get(t, golden, "required").([]any); !slices.Equal(req, []any{"from_vm"}) {
			t.Errorf("RecordGolden required = %v", req)
		}
	})

	t.Run("status codes", func(t *testing.T) {
		create := get(t, doc, "paths", "/vms", "post", "responses")
		for _, s := range []string{"201", "400", "409", "500", "504", "default"} {
			if !has(create, s) {
				t.Errorf("POST /vms has no %s", s)
			}
		}
		del := get(t, doc, "paths", "/vms/{id}", "delete", "responses")
		if !has(del, "204") || has(del, "200") || has(get(t, del, "204"), "content") || !has(del, "404") || !has(del, "409") {
			t.Errorf("DELETE /vms/{id} responses = %v", del)
		}
	})

	t.Run("errors", func(t *testing.T) {
		if strings.Contains(string(js), "google.rpc.Status") {
			t.Error("google.rpc.Status is still referenced")
		}
		if has(get(t, doc, "components", "schemas"), "google.protobuf.Any") {
			t.Error("google.protobuf.Any is still defined")
		}
		codes := get(t, doc, "components", "schemas", "Error", "properties", "error", "properties", "code", "enum").([]any)
		if !slices.Contains(codes, any("not_found")) {
			t.Errorf("error codes = %v", codes)
		}
		ref := get(t, doc, "paths", "/host", "get", "responses", "default", "content", "application/json", "schema", "$ref")
		if ref != "#/components/schemas/Error" {
			t.Errorf("default response schema = %v", ref)
		}
	})

	t.Run("paths", func(t *testing.T) {
		paths := get(t, doc, "paths").(map[string]any)
		if len(paths) == 0 {
			t.Fatal("no paths")
		}
		for p := range paths {
			if strings.HasPrefix(p, "/api/v1/") || !strings.HasPrefix(p, "/") {
				t.Errorf("path %s is not relative to the server", p)
			}
		}
		if servers, _ := doc["servers"].([]any); len(servers) != 1 || get(t, servers[0], "url") != "/api/v1" {
			t.Errorf("servers = %v, want /api/v1", doc["servers"])
		}
		for _, p := range []string{"/openapi.yaml", "/openapi.json", "/host", "/vms/{id}/forward"} {
			if !has(paths, p) {
				t.Errorf("no path %s", p)
			}
		}
	})

	t.Run("the original's names", func(t *testing.T) {
		ids := map[string]string{}
		for path, item := range get(t, doc, "paths").(map[string]any) {
			for method, op := range item.(map[string]any) {
				ids[strings.ToUpper(method)+" "+path] = get(t, op, "operationId").(string)
			}
		}
		for route, id := range map[string]string{
			"GET /host": "getHost", "GET /vms": "listVMs", "POST /vms": "createVM", "GET /vms/{id}": "getVM",
			"POST /vms/{id}/forward": "forwardPort", "POST /vms/{id}/exec": "execVM", "GET /vms/{id}/console": "getVMConsole",
			"GET /openapi.yaml": "getOpenAPI", "GET /policies": "listImagePolicies",
		} {
			if ids[route] != id {
				t.Errorf("%s operationId = %q, want %q", route, ids[route], id)
			}
		}
		for _, name := range []string{"Host", "VM", "Network", "Image", "CreateVMRequest", "ExecRequest", "ExecResult", "Console", "Attestation", "Metrics", "Forward", "ForwardRequest", "Error"} {
			if !has(get(t, doc, "components", "schemas"), name) {
				t.Errorf("no schema %s", name)
			}
		}
		if strings.Contains(string(js), `"vmmanager.`) || strings.Contains(string(js), "Service_") {
			t.Error("a proto full name or plugin operationId is left")
		}
	})

	t.Run("required and nullable", func(t *testing.T) {
		req := get(t, doc, "components", "schemas", "Console", "required").([]any)
		if !slices.Equal(req, []any{"id", "lines", "console"}) {
			t.Errorf("Console required = %v", req)
		}
		guest := get(t, doc, "components", "schemas", "Metrics", "properties", "guest", "oneOf").([]any)
		if len(guest) != 2 || get(t, guest[0], "type") != "null" || get(t, guest[1], "$ref") != schemaRef+"GuestMetrics" {
			t.Errorf("Metrics.guest = %v, want null or GuestMetrics", guest)
		}
		walk(doc, func(o obj) {
			if _, ok := o["readOnly"]; ok {
				t.Errorf("readOnly left in %v", o)
			}
			if list, ok := o["allOf"].([]any); ok && len(list) == 1 {
				t.Errorf("single allOf left in %v", o)
			}
		})
	})

	t.Run("numbers", func(t *testing.T) {
		if cpus := get(t, doc, "components", "schemas", "VM", "properties", "cpus"); has(cpus, "format") {
			t.Errorf("VM.cpus = %v, want no format (the original's integer)", cpus)
		}
		if f := get(t, doc, "components", "schemas", "Host", "properties", "memoryBytes", "format"); f != "int64" {
			t.Errorf("Host.memoryBytes format = %v, want int64", f)
		}
	})

	t.Run("refs resolve", func(t *testing.T) {
		schemas := get(t, doc, "components", "schemas").(map[string]any)
		walk(doc, func(o obj) {
			if ref, ok := o["$ref"].(string); ok && !has(schemas, strings.TrimPrefix(ref, schemaRef)) {
				t.Errorf("dangling $ref %s", ref)
			}
		})
	})

	t.Run("yaml is the same document", func(t *testing.T) {
		var y any
		if err := yaml.Unmarshal(ym, &y); err != nil {
			t.Fatal(err)
		}
		b, err := json.Marshal(y)
		if err != nil {
			t.Fatal(err)
		}
		var fromYAML map[string]any
		if err := json.Unmarshal(b, &fromYAML); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(fromYAML, doc) {
			t.Error("the YAML document differs from the JSON one")
		}
	})

	t.Run("deterministic", func(t *testing.T) {
		js2, ym2 := generate(t)
		if !bytes.Equal(js, js2) || !bytes.Equal(ym, ym2) {
			t.Error("two runs produced different bytes")
		}
		if !bytes.HasSuffix(js, []byte("}\n")) || !bytes.HasPrefix(js, []byte("{\n  \"")) {
			t.Error("JSON is not 2-space indented with a trailing newline")
		}
	})
}

// write puts docs (relative name → JSON) into a fresh input directory.
func write(t *testing.T, docs map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, body := range docs {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestConflicts(t *testing.T) {
	const op = `{"operationId":"HypervisorService_GetHost","responses":{"default":{"description":"x"},"200":{"description":"x"}}}`
	const put = `{"operationId":"HypervisorService_GetNetwork","responses":{"default":{"description":"x"},"200":{"description":"x"}}}`
	for name, docs := range map[string]map[string]string{
		"path and method": {
			"a.json": `{"openapi":"3.1.0","paths":{"/api/v1/host":{"get":` + op + `}}}`,
			"b.json": `{"openapi":"3.1.0","paths":{"/api/v1/host":{"get":` + op + `}}}`,
		},
		"schema": {
			"a.json": `{"openapi":"3.1.0","components":{"schemas":{"X":{"type":"string"}}}}`,
			"b.json": `{"openapi":"3.1.0","components":{"schemas":{"X":{"type":"integer"}}}}`,
		},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := build(write(t, docs)); err == nil {
				t.Error("build succeeded, want a conflict error")
			}
		})
	}

	// The same path with different methods, and identical schemas, merge.
	docs := map[string]string{
		"a.json": `{"openapi":"3.1.0","paths":{"/api/v1/host":{"get":` + op + `}},"components":{"schemas":{"X":{"type":"string"}}}}`,
		"b.json": `{"openapi":"3.1.0","paths":{"/api/v1/host":{"put":` + put + `}},"components":{"schemas":{"X":{"type":"string"}}}}`,
	}
	doc, err := build(write(t, docs))
	if err != nil {
		t.Fatal(err)
	}
	if item := asObj(asObj(doc["paths"])["/host"]); item["get"] == nil || item["put"] == nil {
		t.Errorf("merged path item = %v", item)
	}
}
