package main

import (
	"reflect"
	"testing"
)

// The fleet's node parameter is left out where it would be an operation's
// first query parameter (a generated client's signature would change), and
// kept beside others.
func TestHideFleetParams(t *testing.T) {
	q := func(name string) any { return obj{"name": name, "in": "query"} }
	path := obj{"name": "id", "in": "path"}
	alone := obj{"parameters": []any{q("node")}}
	withPath := obj{"parameters": []any{path, q("node")}}
	beside := obj{"parameters": []any{q("node"), q("lines")}}
	hideFleetParams([]operation{{op: alone}, {op: withPath}, {op: beside}})
	if _, ok := alone["parameters"]; ok {
		t.Errorf("alone: %v", alone)
	}
	if got := withPath["parameters"]; !reflect.DeepEqual(got, []any{path}) {
		t.Errorf("with a path parameter: %v", got)
	}
	if got := beside["parameters"].([]any); len(got) != 2 {
		t.Errorf("beside another query parameter: %v", got)
	}
}
