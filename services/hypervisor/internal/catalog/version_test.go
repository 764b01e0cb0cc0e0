package catalog

import (
	"slices"
	"testing"
)

func TestCompareVersions(t *testing.T) {
	tests := []struct {
		a, b string
		want int
	}{
		{"0.1.0", "0.1.0", 0},
		{"0.10.0", "0.9.0", 1},     // numeric, not lexical
		{"0.9.0", "0.9.0-rc1", 1},  // a pre-release sorts below its release
		{"0.10.0", "0.9.0-rc1", 1}, // transitively
		{"0.9.0-rc2", "0.9.0-rc1", 1},
		{"0.9.0-rc.10", "0.9.0-rc.9", 1}, // dotted pre-release components are numeric too
		{"0.9.0-rc10", "0.9.0-rc9", -1},  // not all digits: lexical
		{"1.0.0a", "1.0.0b", -1},         // lexical where not both numbers
		{"1.0.10a", "1.0.9a", -1},        // lexical: "1" < "9"
		{"1.2", "1.10", -1},
		{"1.0", "1.0.0", -1}, // a longer version with the same prefix is newer
		{"2", "10", -1},
		{"01", "1", -1}, // numerically equal: the string order decides
		{"99999999999999999999999", "99999999999999999999998", 1}, // no overflow
	}
	for _, tt := range tests {
		if got := CompareVersions(tt.a, tt.b); got != tt.want {
			t.Errorf("CompareVersions(%q, %q) = %d, want %d", tt.a, tt.b, got, tt.want)
		}
		if got := CompareVersions(tt.b, tt.a); got != -tt.want {
			t.Errorf("CompareVersions(%q, %q) = %d, want %d (antisymmetry)", tt.b, tt.a, got, -tt.want)
		}
	}
}

func TestCompareVersionsSort(t *testing.T) {
	got := []string{"0.9.0-rc1", "0.10.0", "0.1.0", "0.9.0", "0.9.0-rc2", "1.0.0"}
	slices.SortFunc(got, CompareVersions)
	want := []string{"0.1.0", "0.9.0-rc1", "0.9.0-rc2", "0.9.0", "0.10.0", "1.0.0"}
	if !slices.Equal(got, want) {
		t.Errorf("sorted = %q, want %q", got, want)
	}
}
