package main

import (
	"bytes"
	"io"
	"os"
	"strings"
	"testing"
)

// A guest series limit below 1 is refused at start, from the flag and from
// its environment variable, before anything is opened.
func TestGuestSeriesLimitRefused(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  string
	}{
		{args: []string{"serve", "--metrics-guest-series-limit=0"}},
		{args: []string{"serve"}, env: "0"},
	} {
		state := t.TempDir()
		t.Setenv("VM_MANAGER_STATE_DIR", state)
		t.Setenv("VM_MANAGER_METRICS_GUEST_SERIES_LIMIT", tc.env)
		if tc.env == "" {
			os.Unsetenv("VM_MANAGER_METRICS_GUEST_SERIES_LIMIT")
		}
		var stderr bytes.Buffer
		if code := run(tc.args, io.Discard, &stderr); code == 0 || !strings.Contains(stderr.String(), "--metrics-guest-series-limit=0: want at least 1") {
			t.Errorf("%v (env %q): exit %d, stderr %q", tc.args, tc.env, code, stderr.String())
		}
		if ents, _ := os.ReadDir(state); len(ents) != 0 {
			t.Errorf("%v: the refused start wrote %d entries into the state directory", tc.args, len(ents))
		}
	}
}
