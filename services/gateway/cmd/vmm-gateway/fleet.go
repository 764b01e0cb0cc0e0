package main

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet"
	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet/kube"
)

// fleetSocket is where a fleet gateway's router serves its surfaces, in the
// run directory.
const fleetSocket = "fleet.sock"

// fleetFlags are the fleet mode's flags (docs/fleet.md); the returned
// function builds the discovery, or nil when fleet mode is off.
func fleetFlags(fs *cli.FlagSet) func(log *slog.Logger) (fleet.Discovery, string, error) {
	nodes := fs.String("fleet-nodes", "VM_MANAGER_FLEET_NODES", "", "fleet mode with a static list of node gateways, name=index@host:port,... (index: the node's --node-index)")
	discovery := fs.String("fleet-discovery", "VM_MANAGER_FLEET_DISCOVERY", "static", "how a fleet gateway finds its nodes: static (--fleet-nodes) or kubernetes (the EndpointSlices of --fleet-service)")
	caFile := fs.String("fleet-ca-file", "VM_MANAGER_FLEET_CA_FILE", "", "CA (PEM) verifying the node gateways' TLS certificates; without it node connections are plaintext, allowed for loopback node addresses only")
	kubeCfg := kube.Flags(fs)
	return func(log *slog.Logger) (fleet.Discovery, string, error) {
		switch *discovery {
		case "static":
			if *nodes == "" {
				return nil, "", nil
			}
			d, err := fleet.ParseStatic(*nodes)
			if err != nil {
				return nil, "", fmt.Errorf("--fleet-nodes: %w", err)
			}
			return d, *caFile, nil
		case "kubernetes":
			d, err := kube.NewInCluster(kubeCfg(), log)
			if err != nil {
				return nil, "", err
			}
			return d, *caFile, nil
		default:
			return nil, "", fmt.Errorf("--fleet-discovery=%q: want static or kubernetes", *discovery)
		}
	}
}

// startFleet runs the router over disc and serves it on the run
// directory's fleet socket, which becomes the gateway's backend (the
// router also answers /readyz); the returned channel reports the first of them to end with an error.
func startFleet(ctx context.Context, disc fleet.Discovery, caFile, runDir string, log *slog.Logger) (*fleet.Router, string, <-chan error, error) {
	dial, err := fleet.NewDialer(caFile)
	if err != nil {
		return nil, "", nil, err
	}
	r := fleet.NewRouter(disc, dial, log.With("component", "fleet"))
	sock := filepath.Join(runDir, fleetSocket)
	errc := make(chan error, 2)
	go func() { errc <- r.Run(ctx) }()
	go func() { errc <- r.Serve(ctx, sock, log) }()
	return r, sock, errc, nil
}
