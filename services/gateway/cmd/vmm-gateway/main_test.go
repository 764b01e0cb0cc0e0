package main

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet/kube"
)

// --fleet-discovery: static leaves the choice to --fleet-nodes, kubernetes
// outside a cluster says why it cannot start, anything else is refused.
func TestDiscoveryFlag(t *testing.T) {
	fs := cli.New("vmm-gateway serve", "")
	cfg := kube.Flags(fs)
	if err := fs.Parse([]string{"--fleet-service=vmm-nodes"}, func(env string) string {
		return map[string]string{"VM_MANAGER_FLEET_NAMESPACE": "vmm", "VM_MANAGER_FLEET_PORT_NAME": "api"}[env]
	}); err != nil {
		t.Fatal(err)
	}
	if c := cfg(); c.Namespace != "vmm" || c.Service != "vmm-nodes" || c.PortName != "api" || c.ServerNameSuffix != "" {
		t.Errorf("config %+v", c)
	}
	log := slog.New(slog.DiscardHandler)
	if d, err := discovery("static", cfg, log); d != nil || err != nil {
		t.Errorf("static: %v, %v", d, err)
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if _, err := discovery("kubernetes", cfg, log); err == nil || !strings.Contains(err.Error(), "kubernetes discovery") {
		t.Errorf("kubernetes outside a cluster: %v", err)
	}
	if _, err := discovery("consul", cfg, log); err == nil || !strings.Contains(err.Error(), "want static or kubernetes") {
		t.Errorf("consul: %v", err)
	}
}
