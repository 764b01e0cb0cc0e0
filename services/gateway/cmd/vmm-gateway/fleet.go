package main

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet"
)

// fleetSocket is where a fleet gateway's router serves its surfaces, in the
// run directory.
const fleetSocket = "fleet.sock"

// fleetFlags are the fleet mode's flags (docs/fleet.md); the returned
// function builds the discovery, or nil when fleet mode is off.
func fleetFlags(fs *cli.FlagSet) func() (fleet.Discovery, string, error) {
	nodes := fs.String("fleet-nodes", "VM_MANAGER_FLEET_NODES", "", "fleet mode with a static list of node gateways, name=index@host:port,... (index: the node's --node-index)")
	discovery := fs.String("fleet-discovery", "VM_MANAGER_FLEET_DISCOVERY", "static", "how a fleet gateway finds its nodes: static (--fleet-nodes) or kubernetes (the EndpointSlices of --fleet-service)")
	caFile := fs.String("fleet-ca-file", "VM_MANAGER_FLEET_CA_FILE", "", "CA (PEM) verifying the node gateways' TLS certificates; without it node connections are plaintext, allowed for loopback node addresses only")
	namespace := fs.String("fleet-namespace", "VM_MANAGER_FLEET_NAMESPACE", "", "kubernetes discovery: the node pods' namespace (default: this pod's, from its service account)")
	service := fs.String("fleet-service", "VM_MANAGER_FLEET_SERVICE", "", "kubernetes discovery: the headless Service of the node pods")
	portName := fs.String("fleet-port-name", "VM_MANAGER_FLEET_PORT_NAME", "grpc", "kubernetes discovery: the name of the node gateways' port in the EndpointSlices")
	suffix := fs.String("fleet-server-name-suffix", "VM_MANAGER_FLEET_SERVER_NAME_SUFFIX", "", "kubernetes discovery: verify a node's certificate for <pod>.<suffix> (e.g. vmm-nodes.vmm.svc) instead of its address")
	return func() (fleet.Discovery, string, error) {
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
			// The Kubernetes discovery (package fleet/kube) is wired here.
			_, _, _, _ = *namespace, *service, *portName, *suffix
			return nil, "", fmt.Errorf("--fleet-discovery=kubernetes: not built into this gateway yet")
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
