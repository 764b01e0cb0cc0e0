package client

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// hypervisor answers GetVirtualMachine with the caller's authorization as the
// VM name, and not_found for anything but "0a0b0c0d".
type hypervisor struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
}

func (hypervisor) GetVirtualMachine(ctx context.Context, req *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	if req.GetId() != "0a0b0c0d" {
		return nil, apierr.ToStatus(apierr.Errorf(apierr.NotFound, "vm %s not found", req.GetId())).Err()
	}
	md, _ := metadata.FromIncomingContext(ctx)
	return &hypervisorv1.VirtualMachine{Id: req.GetId(), Name: strings.Join(md.Get("authorization"), ",")}, nil
}

func serve(t *testing.T) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "h.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	hypervisorv1.RegisterHypervisorServiceServer(s, hypervisor{})
	go s.Serve(ln)
	t.Cleanup(s.Stop)
	return "unix://" + sock
}

func TestTokenAndDomainErrors(t *testing.T) {
	target := serve(t)
	c, err := Dial(target, WithToken("tok-1"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	vm, err := c.Hypervisor.GetVirtualMachine(context.Background(), &hypervisorv1.GetVirtualMachineRequest{Id: "0a0b0c0d"})
	if err != nil || vm.GetName() != "Bearer tok-1" {
		t.Fatalf("vm %v, err %v", vm, err)
	}
	_, err = c.Hypervisor.GetVirtualMachine(context.Background(), &hypervisorv1.GetVirtualMachineRequest{Id: "ffffffff"})
	var ae *apierr.Error
	if apierr.CodeOf(err) != apierr.NotFound || !asError(err, &ae) || ae.Message != "vm ffffffff not found" {
		t.Fatalf("err %v (%T)", err, err)
	}

	anon, err := Dial(target)
	if err != nil {
		t.Fatal(err)
	}
	defer anon.Close()
	if vm, err := anon.Hypervisor.GetVirtualMachine(context.Background(), &hypervisorv1.GetVirtualMachineRequest{Id: "0a0b0c0d"}); err != nil || vm.GetName() != "" {
		t.Fatalf("anonymous: %v %v", vm, err)
	}
}

func asError(err error, target **apierr.Error) bool {
	e, ok := err.(*apierr.Error)
	*target = e
	return ok
}

func TestTokenInClearRefused(t *testing.T) {
	for _, target := range []string{"10.0.0.1:8080", "vmm.example.com:443", "dns:///vmm.example.com:443"} {
		if _, err := Dial(target, WithToken("t")); err == nil || !strings.Contains(err.Error(), "in clear") {
			t.Errorf("%s: err %v", target, err)
		}
	}
	for _, target := range []string{"127.0.0.1:8080", "localhost:8080", "[::1]:8080", "unix:///run/vmm/h.sock"} {
		c, err := Dial(target, WithToken("t"))
		if err != nil {
			t.Errorf("%s: %v", target, err)
			continue
		}
		c.Close()
	}
	if c, err := Dial("10.0.0.1:8080", WithToken("t"), WithInsecureToken()); err != nil {
		t.Errorf("WithInsecureToken: %v", err)
	} else {
		c.Close()
	}
}
