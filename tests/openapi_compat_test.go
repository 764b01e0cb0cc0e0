package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// knownDifferences are the differences from the original's surface that
// docs/compatibility.md lists, each with the reason. The test fails on any
// other difference, and on an entry here that no longer occurs.
var knownDifferences = map[string]string{
	"Metrics.host.memory_rss_bytes: integer/int64, the original integer":       "64-bit counters declare int64",
	"Metrics.host.disk_bytes: integer/int64, the original integer":             "64-bit counters declare int64",
	"Metrics.host.network.bytes_sent: integer/int64, the original integer":     "64-bit counters declare int64",
	"Metrics.host.network.bytes_received: integer/int64, the original integer": "64-bit counters declare int64",
	"GET /vms/{id}/report 200: any, the original object":                       "a non-JSON upload comes back as a JSON string",
}

// TestOpenAPIMatchesOriginal holds the document the gateway serves against
// the original's surface (original_api_test.go), as a client generated from
// the original's document would use it: every path and method, operationId,
// parameter, request and response schema name, success and error status,
// every property the original declares with its type, format and enum
// values, and the required lists. Our additions (operations, properties,
// enum values, error codes) are not differences; the operations among them
// must each be named in docs/compatibility.md.
func TestOpenAPIMatchesOriginal(t *testing.T) {
	c := cluster.Start(t, cluster.InProcess, binDir, cluster.Options{ImageDir: t.TempDir()})
	code, _, body := cluster.Do(t, "GET", "http://"+c.Addr+"/api/v1/openapi.json", "")
	if code != 200 {
		t.Fatalf("GET /api/v1/openapi.json: %d %.200s", code, body)
	}
	var doc map[string]any
	if err := json.Unmarshal(body, &doc); err != nil {
		t.Fatal(err)
	}
	cmp := &surfaceDiff{doc: doc, schemas: object(object(doc["components"])["schemas"])}
	cmp.operations()
	cmp.namedSchemas()

	seen := map[string]bool{}
	for _, d := range cmp.diffs {
		seen[d] = true
		if _, ok := knownDifferences[d]; !ok {
			t.Errorf("differs from the original: %s", d)
		}
	}
	for d := range knownDifferences {
		if !seen[d] {
			t.Errorf("knownDifferences lists %q, which no longer occurs: remove it here and in docs/compatibility.md", d)
		}
	}

	// Our own operations are listed in the compatibility table.
	table, err := os.ReadFile("../docs/compatibility.md")
	if err != nil {
		t.Fatal(err)
	}
	original := map[string]bool{}
	for _, op := range originalOps {
		original[op.id] = true
	}
	for _, id := range cmp.operationIDs() {
		if !original[id] && !strings.Contains(string(table), "`"+id+"`") {
			t.Errorf("operation %s is not the original's and docs/compatibility.md does not list it", id)
		}
	}
}

// surfaceDiff collects the differences of a served document from the
// original's surface, as one line each.
type surfaceDiff struct {
	doc, schemas map[string]any
	diffs        []string
}

func (d *surfaceDiff) add(format string, args ...any) {
	d.diffs = append(d.diffs, fmt.Sprintf(format, args...))
}

func object(v any) map[string]any {
	o, _ := v.(map[string]any)
	return o
}

func (d *surfaceDiff) operationIDs() []string {
	var ids []string
	for _, item := range object(d.doc["paths"]) {
		for _, op := range object(item) {
			if id, ok := object(op)["operationId"].(string); ok {
				ids = append(ids, id)
			}
		}
	}
	sort.Strings(ids)
	return ids
}

func (d *surfaceDiff) operations() {
	servers, _ := d.doc["servers"].([]any)
	if len(servers) != 1 || object(servers[0])["url"] != originalServer {
		d.add("servers %v, the original %s", d.doc["servers"], originalServer)
	}
	for _, o := range originalOps {
		route := o.method + " " + o.path
		item := object(object(d.doc["paths"])[o.path])
		op := object(item[strings.ToLower(o.method)])
		if op == nil {
			d.add("%s: missing", route)
			continue
		}
		if op["operationId"] != o.id {
			d.add("%s: operationId %v, the original %s", route, op["operationId"], o.id)
		}
		d.params(route, o, append(slices.Clone(listOf(item["parameters"])), listOf(op["parameters"])...))
		content := object(object(op["requestBody"])["content"])
		switch ref := object(object(content["application/json"])["schema"])["$ref"]; {
		case o.body == "" && op["requestBody"] != nil && object(op["requestBody"])["required"] == true:
			d.add("%s: requires a body, the original none", route)
		case o.body != "" && ref != "#/components/schemas/"+o.body[1:]:
			d.add("%s: body %v, the original %s", route, ref, o.body)
		}
		responses := object(op["responses"])
		status := fmt.Sprint(o.status)
		resp := object(responses[status])
		if resp == nil {
			d.add("%s: no %s response", route, status)
			continue
		}
		d.result(route+" "+status, o.result, object(resp["content"]))
		for _, s := range o.errors {
			ref := object(object(object(object(responses[fmt.Sprint(s)])["content"])["application/json"])["schema"])["$ref"]
			if ref != "#/components/schemas/Error" {
				d.add("%s: no %d response with the Error envelope", route, s)
			}
		}
	}
}

func listOf(v any) []any { l, _ := v.([]any); return l }

func (d *surfaceDiff) params(route string, o origOp, ours []any) {
	have := map[string]map[string]any{}
	for _, p := range ours {
		p := object(p)
		have[fmt.Sprint(p["in"], ":", p["name"])] = p
	}
	want := map[string]bool{}
	for _, p := range o.params {
		key, required := strings.CutSuffix(p, "!")
		want[key] = true
		got := have[key]
		if got == nil {
			d.add("%s: no parameter %s", route, key)
			continue
		}
		if r, _ := got["required"].(bool); r != required {
			d.add("%s: parameter %s required %v, the original %v", route, key, r, required)
		}
		typ := origParamTypes[o.id+" "+key]
		if typ == "" {
			typ = "string"
		}
		if got := object(got["schema"])["type"]; got != typ {
			d.add("%s: parameter %s of type %v, the original %s", route, key, got, typ)
		}
	}
	for key, p := range have {
		if r, _ := p["required"].(bool); r && !want[key] {
			d.add("%s: requires parameter %s, which the original does not have", route, key)
		}
	}
}

func (d *surfaceDiff) result(where, want string, content map[string]any) {
	switch {
	case want == "":
		if len(content) > 0 {
			d.add("%s: has a body, the original none", where)
		}
	case where == "GET /openapi.yaml 200":
		if content["application/yaml"] == nil {
			d.add("%s: not application/yaml", where)
		}
	default:
		d.prop(where, "", want, object(object(content["application/json"])["schema"]))
	}
}

// namedSchemas compares every named schema of the original with ours of the
// same name.
func (d *surfaceDiff) namedSchemas() {
	var names []string
	for name := range originalSchemas {
		if !strings.Contains(name, ".") {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		s := object(d.schemas[name])
		if s == nil {
			d.add("schema %s: missing", name)
			continue
		}
		d.object(name, s)
	}
}

// object compares an object schema of ours with the original's schema key.
func (d *surfaceDiff) object(key string, s map[string]any) {
	want := originalSchemas[key]
	props := object(s["properties"])
	var names []string
	for p := range want.props {
		names = append(names, p)
	}
	sort.Strings(names)
	for _, p := range names {
		got := object(props[p])
		if got == nil {
			d.add("%s.%s: missing", key, p)
			continue
		}
		d.prop(key+"."+p, key, want.props[p], got)
	}
	var required []string
	for _, r := range listOf(s["required"]) {
		if _, theirs := want.props[r.(string)]; theirs {
			required = append(required, r.(string))
		}
	}
	for _, r := range want.required {
		if !slices.Contains(required, r) {
			d.add("%s: %s is not required, in the original it is", key, r)
		}
	}
	for _, r := range required {
		if !slices.Contains(want.required, r) {
			d.add("%s: %s is required, in the original it is not", key, r)
		}
	}
}

// prop compares one schema of ours with the original's type notation;
// parent is the schema key an inline ".name" is relative to.
func (d *surfaceDiff) prop(where, parent, want string, s map[string]any) {
	want, nullable := strings.CutSuffix(want, "?")
	if inner, isNull := d.nullable(s); isNull != nullable {
		d.add("%s: nullable %v, the original %v", where, isNull, nullable)
		return
	} else if isNull {
		s = inner
	}
	switch {
	case want == "any":
	case strings.HasPrefix(want, "[]"):
		if d.resolve(s)["type"] != "array" {
			d.add("%s: %s, the original an array", where, describe(d.resolve(s)))
			return
		}
		d.prop(where+"[]", parent, want[2:], object(d.resolve(s)["items"]))
	case strings.HasPrefix(want, "#"):
		if ref := s["$ref"]; ref != "#/components/schemas/"+want[1:] {
			d.add("%s: %s, the original %s", where, describe(s), want)
		}
	case strings.HasPrefix(want, "."):
		key := parent + want
		if d.resolve(s)["type"] != "object" {
			d.add("%s: %s, the original an object", where, describe(d.resolve(s)))
			return
		}
		d.object(key, d.resolve(s))
	default:
		r := d.resolve(s)
		typ, enum, _ := strings.Cut(want, ":")
		if got := describe(r); got != typ {
			d.add("%s: %s, the original %s", where, got, typ)
		}
		if enum != "" {
			have := listOf(r["enum"])
			for _, v := range strings.Split(enum, "|") {
				if !slices.Contains(have, any(v)) {
					d.add("%s: no enum value %s", where, v)
				}
			}
		}
	}
}

// nullable says whether s admits null, and what else it admits.
func (d *surfaceDiff) nullable(s map[string]any) (map[string]any, bool) {
	if types, ok := s["type"].([]any); ok && slices.Contains(types, any("null")) {
		out := map[string]any{}
		for k, v := range s {
			out[k] = v
		}
		for _, t := range types {
			if t != "null" {
				out["type"] = t
			}
		}
		return out, true
	}
	var other map[string]any
	null := false
	for _, alt := range listOf(s["oneOf"]) {
		if object(alt)["type"] == "null" {
			null = true
		} else {
			other = object(alt)
		}
	}
	return other, null
}

// resolve follows a $ref to the schema.
func (d *surfaceDiff) resolve(s map[string]any) map[string]any {
	if ref, ok := s["$ref"].(string); ok {
		return object(d.schemas[strings.TrimPrefix(ref, "#/components/schemas/")])
	}
	return s
}

// describe is a schema in the notation: type, and format when it has one.
func describe(s map[string]any) string {
	typ, ok := s["type"].(string)
	if !ok {
		return "any"
	}
	if f, ok := s["format"].(string); ok {
		return typ + "/" + f
	}
	return typ
}
