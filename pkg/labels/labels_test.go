package labels

import (
	"maps"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want map[string]string
		err  string
	}{
		{in: "", want: map[string]string{}},
		{in: "zone=a, gpu=", want: map[string]string{"zone": "a", "gpu": ""}},
		{in: "zone", err: "want key=value"},
		{in: "=a", err: "want key=value"},
		{in: "a=1,a=2", err: "twice"},
		{in: func() string {
			var b []string
			for i := range MaxLabels + 1 {
				b = append(b, "k"+strings.Repeat("x", i)+"=1")
			}
			return strings.Join(b, ",")
		}(), err: "more than"},
	} {
		got, err := Parse(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("Parse(%.20q) = %v, want error %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || !maps.Equal(got, tc.want) {
			t.Errorf("Parse(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

func TestMatch(t *testing.T) {
	set := map[string]string{"zone": "a", "gpu": "yes"}
	if !Match(nil, set) || !Match(map[string]string{"zone": "a"}, set) {
		t.Error("a subset does not match")
	}
	if Match(map[string]string{"zone": "b"}, set) || Match(map[string]string{"ssd": ""}, set) {
		t.Error("a differing selector matches")
	}
}
