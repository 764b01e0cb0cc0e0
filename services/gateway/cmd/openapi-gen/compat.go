package main

import "slices"

// fleetOnlyParams are query parameters only a fleet gateway reads
// (docs/fleet.md): the node an image, network or host report is asked of.
var fleetOnlyParams = []string{"node"}

// hideFleetParams leaves a fleet-only query parameter out of an operation
// whose only query parameters they are. The original's document had no query
// parameters there, and a client generated from it (oapi-codegen, openapi-
// generator) gains a required params argument with the first one: every
// caller's code would stop compiling for a parameter a single host ignores.
// The gateway still reads it (?node=, grpc-gateway binds query parameters to
// request fields whatever the document says); fleet callers pass it by hand.
func hideFleetParams(ops []operation) {
	for _, o := range ops {
		params, _ := o.op["parameters"].([]any)
		var kept []any
		hidden, otherQuery := 0, false
		for _, p := range params {
			po := asObj(p)
			if po["in"] != "query" {
				kept = append(kept, p)
				continue
			}
			name, _ := po["name"].(string)
			if slices.Contains(fleetOnlyParams, name) {
				hidden++
				continue
			}
			otherQuery = true
			kept = append(kept, p)
		}
		if hidden == 0 || otherQuery {
			continue
		}
		if len(kept) == 0 {
			delete(o.op, "parameters")
		} else {
			o.op["parameters"] = kept
		}
	}
}
