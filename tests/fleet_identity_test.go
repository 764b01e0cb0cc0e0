package tests

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TestFleetIdentity: with OIDC on every process, the fleet gateway refuses
// a caller without a token, and forwards a good one to the node gateways,
// which verify it again and act as that caller (a network created through
// the fleet on every node records the caller on each). No VM boots.
func TestFleetIdentity(t *testing.T) {
	op := oidctest.Start(t)
	images := t.TempDir()
	writeCatalog(t, images)
	f := cluster.StartFleet(t, binDir, 2, cluster.Options{ImageDir: images, OIDCIssuer: op.Issuer(), OIDCAudiences: []string{op.Audience}},
		func(int) string { return "" })
	base := "http://" + f.Addr + "/api/v1"
	if code, _, b := authDo(t, "GET", base+"/vms", "", ""); code != 401 {
		t.Errorf("list without a token: %d %s", code, b)
	}
	tok := "Bearer " + op.Token(oidctest.Claims{Subject: "u-fleet", Email: "fleet@example.com"})
	if code, hdr, b := authDo(t, "GET", base+"/vms", tok, ""); code != 200 || hdr.Get("Warning") != "" {
		t.Errorf("list with a token: %d %q %s", code, hdr.Values("Warning"), b)
	}
	if code, _, b := authDo(t, "POST", base+"/networks", tok, `{"name":"fnet","cidr":"10.99.0.0/24"}`); code != 201 {
		t.Fatalf("fleet-wide network create: %d %s", code, b)
	}
	code, _, b := authDo(t, "GET", base+"/networks", tok, "")
	var nets []struct {
		Spec      struct{ Name string }
		Node      string
		CreatedBy string
	}
	if code != 200 || json.Unmarshal(b, &nets) != nil {
		t.Fatalf("networks: %d %s", code, b)
	}
	on := map[string]string{}
	for _, n := range nets {
		if n.Spec.Name == "fnet" {
			on[n.Node] = n.CreatedBy
		}
	}
	if len(on) != 2 || !strings.Contains(on["node-0"], "u-fleet") && !strings.Contains(on["node-0"], "fleet@example.com") || on["node-0"] != on["node-1"] {
		t.Errorf("fnet on the nodes, by: %v", on)
	}
	conn, err := grpc.NewClient(f.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hv := hypervisorv1.NewHypervisorServiceClient(conn)
	if _, err := hv.ListVirtualMachines(context.Background(), &hypervisorv1.ListVirtualMachinesRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("gRPC list without a token: %v", err)
	}
	resp, err := hv.ListVirtualMachines(context.Background(), &hypervisorv1.ListVirtualMachinesRequest{}, grpc.PerRPCCredentials(identity.Bearer(strings.TrimPrefix(tok, "Bearer "))))
	if err != nil || len(resp.GetWarnings()) != 0 {
		t.Errorf("gRPC list with a token: %v %v", err, resp.GetWarnings())
	}
}
