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

// The network bounds are refused below their minimum, from the flag and from
// the environment, before anything is opened.
func TestNetworkBoundsRefused(t *testing.T) {
	for _, tc := range []struct {
		args      []string
		env, val  string
		wantError string
	}{
		{args: []string{"serve", "--max-nat-flows-udp=0"}, wantError: "--max-nat-flows-udp=0: want at least 1"},
		{args: []string{"serve"}, env: "VM_MANAGER_MAX_NAT_FLOWS_TCP", val: "-1", wantError: "--max-nat-flows-tcp=-1: want at least 1"},
		{args: []string{"serve"}, env: "VM_MANAGER_MAX_NAT_FLOWS", val: "0", wantError: "--max-nat-flows=0: want at least 1"},
		{args: []string{"serve", "--max-imds-connections=0"}, wantError: "--max-imds-connections=0: want at least 1"},
		{args: []string{"serve", "--nat-udp-idle-timeout=10ms"}, wantError: "--nat-udp-idle-timeout=10ms: want at least 1s"},
		{args: []string{"serve"}, env: "VM_MANAGER_IMDS_READ_TIMEOUT", val: "0s", wantError: "--imds-read-timeout=0s: want at least 1s"},
		{args: []string{"serve", "--imds-idle-timeout=500ms"}, wantError: "--imds-idle-timeout=500ms: want at least 1s"},
	} {
		state := t.TempDir()
		t.Setenv("VM_MANAGER_STATE_DIR", state)
		if tc.env != "" {
			t.Setenv(tc.env, tc.val)
		}
		var stderr bytes.Buffer
		if code := run(tc.args, io.Discard, &stderr); code == 0 || !strings.Contains(stderr.String(), tc.wantError) {
			t.Errorf("%v (%s=%s): exit %d, stderr %q", tc.args, tc.env, tc.val, code, stderr.String())
		}
		if tc.env != "" {
			os.Unsetenv(tc.env)
		}
		if ents, _ := os.ReadDir(state); len(ents) != 0 {
			t.Errorf("%v: the refused start wrote %d entries into the state directory", tc.args, len(ents))
		}
	}
}

// The fleet flags are checked at start: an index a VM id's 3 hex characters
// cannot hold, or labels that do not parse, are refused before anything is
// opened.
func TestFleetFlagsRefused(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{args: []string{"serve", "--node-index=4096"}, want: "--node-index=4096: want -1 (no fleet) or 0..4095"},
		{args: []string{"serve", "--node-index=-2"}, want: "--node-index=-2"},
		{args: []string{"serve", "--node-labels=zone"}, want: "--node-labels: label \"zone\": want key=value"},
	} {
		state := t.TempDir()
		t.Setenv("VM_MANAGER_STATE_DIR", state)
		var stderr bytes.Buffer
		if code := run(tc.args, io.Discard, &stderr); code == 0 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, stderr %q", tc.args, code, stderr.String())
		}
		if ents, _ := os.ReadDir(state); len(ents) != 0 {
			t.Errorf("%v: the refused start wrote %d entries into the state directory", tc.args, len(ents))
		}
	}
	n, err := fleetNode(7, "node-7", "zone=a,gpu=")
	if err != nil || n.Name != "node-7" || n.Index == nil || *n.Index != 7 || n.Labels["zone"] != "a" || len(n.Labels) != 2 {
		t.Errorf("fleetNode: %+v %v", n, err)
	}
	if n, _ := fleetNode(-1, "", ""); n.Index != nil {
		t.Errorf("no fleet: index %v", *n.Index)
	}
}
