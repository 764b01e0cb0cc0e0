package catalog

import "strings"

// CompareVersions orders image and Kubernetes versions: -1 when a < b, 0 when
// a == b, +1 when a > b. Dotted components compare numerically where both are
// numbers, else lexically; a pre-release (after the first '-') sorts below its
// release: 0.10.0 > 0.9.0 > 0.9.0-rc1. It is a total order: versions that
// only differ in spelling (01 vs 1) fall back to a plain string comparison.
func CompareVersions(a, b string) int {
	if a == b {
		return 0
	}
	relA, preA, hasPreA := strings.Cut(a, "-")
	relB, preB, hasPreB := strings.Cut(b, "-")
	if c := compareDotted(relA, relB); c != 0 {
		return c
	}
	switch {
	case hasPreA && !hasPreB:
		return -1
	case !hasPreA && hasPreB:
		return 1
	}
	if c := compareDotted(preA, preB); c != 0 {
		return c
	}
	return strings.Compare(a, b)
}

func compareDotted(a, b string) int {
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := range min(len(pa), len(pb)) {
		if c := compareComponent(pa[i], pb[i]); c != 0 {
			return c
		}
	}
	// 1.0 < 1.0.1: more components is newer when the common prefix is equal.
	switch {
	case len(pa) < len(pb):
		return -1
	case len(pa) > len(pb):
		return 1
	}
	return 0
}

func compareComponent(a, b string) int {
	if isNumber(a) && isNumber(b) {
		// Compare digit strings without parsing, so long ones cannot overflow.
		a, b = strings.TrimLeft(a, "0"), strings.TrimLeft(b, "0")
		if len(a) != len(b) {
			if len(a) < len(b) {
				return -1
			}
			return 1
		}
	}
	return strings.Compare(a, b)
}

func isNumber(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}
