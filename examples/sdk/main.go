// Command sdk is a runnable example of the Go SDK: it dials vm-manager with
// an optional bearer token, prints the host and the networks, and shows how
// a domain error reads.
//
//	go run . -addr 127.0.0.1:8080 [-token $ID_TOKEN]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/sdk/client"
)

func main() {
	addr := flag.String("addr", envOr("VMM_ADDR", "127.0.0.1:8080"), "gateway host:port or unix:///path of a backend socket (env VMM_ADDR)")
	token := flag.String("token", os.Getenv("VMM_TOKEN"), "bearer token, an OIDC id_token (env VMM_TOKEN)")
	flag.Parse()
	if err := run(*addr, *token); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

func run(addr, token string) error {
	var opts []client.Option
	if token != "" {
		opts = append(opts, client.WithToken(token))
	}
	c, err := client.Dial(addr, opts...)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	host, err := c.Hypervisor.GetHost(ctx, &hypervisorv1.GetHostRequest{})
	if err != nil {
		return fmt.Errorf("get host: %w", err)
	}
	fmt.Printf("host %s: ready=%t, qemu %s\n", host.GetHostname(), host.GetReady(), host.GetQemu().GetVersion())

	nets, err := c.Hypervisor.ListNetworks(ctx, &hypervisorv1.ListNetworksRequest{})
	if err != nil {
		return fmt.Errorf("list networks: %w", err)
	}
	for _, n := range nets.GetNetworks() {
		fmt.Printf("network %s %s (%d leases)\n", n.GetSpec().GetName(), n.GetSpec().GetCidr(), len(n.GetLeases()))
	}

	_, err = c.Hypervisor.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: "ffffffff"})
	switch apierr.CodeOf(err) {
	case apierr.NotFound:
		fmt.Println("vm ffffffff: not_found, as expected")
	default:
		return fmt.Errorf("get vm ffffffff: want not_found, got %v", err)
	}
	return nil
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
