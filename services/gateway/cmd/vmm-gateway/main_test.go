package main

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet"
)

// --fleet-discovery: static is fleet mode only with --fleet-nodes,
// kubernetes outside a cluster says why it cannot start, anything else is
// refused.
func TestFleetDiscoveryFlag(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	parse := func(args ...string) func(*slog.Logger) (fleet.Discovery, string, error) {
		fs := cli.New("vmm-gateway serve", "")
		mode := fleetFlags(fs)
		if err := fs.Parse(args, func(string) string { return "" }); err != nil {
			t.Fatal(err)
		}
		return mode
	}
	if d, _, err := parse()(log); d != nil || err != nil {
		t.Errorf("no fleet flags: %v, %v", d, err)
	}
	if d, ca, err := parse("--fleet-nodes=n0=0@127.0.0.1:1", "--fleet-ca-file=/ca.crt")(log); err != nil || len(d.(fleet.Static)) != 1 || ca != "/ca.crt" {
		t.Errorf("static: %v, %q, %v", d, ca, err)
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if _, _, err := parse("--fleet-discovery=kubernetes", "--fleet-service=vmm-nodes")(log); err == nil || !strings.Contains(err.Error(), "kubernetes discovery") {
		t.Errorf("kubernetes outside a cluster: %v", err)
	}
	if _, _, err := parse("--fleet-discovery=consul")(log); err == nil || !strings.Contains(err.Error(), "want static or kubernetes") {
		t.Errorf("consul: %v", err)
	}
}
