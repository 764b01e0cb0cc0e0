// Package labels reads "k=v,..." label sets: a fleet node's labels
// (hypervisor --node-labels) and the node_selector a create places by.
package labels

import (
	"fmt"
	"strings"
)

// MaxLabels bounds one set, so a selector or a flag cannot grow without end.
const MaxLabels = 64

// Parse reads "k=v[,k=v...]"; empty is no labels. Keys are unique and not
// empty; values may be empty; spaces around items are ignored.
func Parse(s string) (map[string]string, error) {
	out := map[string]string{}
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		k, v, ok := strings.Cut(item, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" {
			return nil, fmt.Errorf("label %q: want key=value", item)
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("label %q: key given twice", k)
		}
		if len(out) == MaxLabels {
			return nil, fmt.Errorf("labels: more than %d", MaxLabels)
		}
		out[k] = v
	}
	return out, nil
}

// Match reports whether set has every key of selector with its value.
func Match(selector, set map[string]string) bool {
	for k, v := range selector {
		if got, ok := set[k]; !ok || got != v {
			return false
		}
	}
	return true
}
