package vm

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"net/netip"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// A create over --max-vms is refused before anything is allocated (no
// record, directory, launch or id), and a restart with a lower bound keeps
// every VM.
func TestMaxVMs(t *testing.T) {
	h := newHarness(t)
	h.m.Close()
	h.limits = Limits{MaxVMs: 2}
	h.start()
	a, b := h.create("a"), h.create("b")
	launches := h.drv.launchCount()
	_, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: "c", RequireAttestation: new(false)}, "tester")
	if apierr.CodeOf(err) != apierr.ResourceExhausted || !strings.Contains(apierr.MessageOf(err), "this host has 2 VMs, the maximum is 2 (--max-vms)") {
		t.Fatalf("third create: %v (%s)", err, apierr.CodeOf(err))
	}
	if n := len(h.m.List()); n != 2 || h.drv.launchCount() != launches {
		t.Errorf("after the refusal: %d VMs, %d launches (was %d)", n, h.drv.launchCount(), launches)
	}
	if recs, _ := h.st.ListVMs(); len(recs) != 2 {
		t.Errorf("%d stored records", len(recs))
	}
	if dirs, _ := os.ReadDir(filepath.Join(h.dir, "vms")); len(dirs) != 2 {
		t.Errorf("%d VM directories", len(dirs))
	}
	if got := h.m.Refusals()[LimitVMs]; got != 1 {
		t.Errorf("refusals counted: %d", got)
	}

	// A lower bound keeps what exists and refuses creates until it fits.
	h.m.Close()
	h.limits = Limits{MaxVMs: 1}
	h.start()
	if n := len(h.m.List()); n != 2 {
		t.Fatalf("a restart with --max-vms=1 left %d of 2 VMs", n)
	}
	if _, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: "c"}, "tester"); apierr.CodeOf(err) != apierr.ResourceExhausted {
		t.Errorf("create over the lowered bound: %v", err)
	}
	for _, v := range []*hypervisorv1.VirtualMachine{a, b} {
		if err := h.m.Delete(context.Background(), v.GetId()); err != nil {
			t.Fatal(err)
		}
	}
	h.create("c")
}

// Networks count the default one; --max-networks refuses the next create
// (resource_exhausted, nothing stored) and a delete makes room.
func TestMaxNetworks(t *testing.T) {
	h := newHarness(t)
	h.m.Close()
	h.limits = Limits{MaxNetworks: 2}
	h.start()
	for i, name := range []string{"n1", "n2"} {
		if _, err := h.m.nets.Create(&hypervisorv1.CreateNetworkRequest{Name: name, Cidr: fmt.Sprintf("10.%d.0.0/24", i)}, "tester"); err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
	}
	_, err := h.m.nets.Create(&hypervisorv1.CreateNetworkRequest{Name: "n3", Cidr: "10.3.0.0/24"}, "tester")
	if apierr.CodeOf(err) != apierr.ResourceExhausted || !strings.Contains(apierr.MessageOf(err), "this host has 2 networks, the maximum is 2 (--max-networks)") {
		t.Fatalf("third network: %v (%s)", err, apierr.CodeOf(err))
	}
	if _, err := h.m.nets.Get("n3"); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("refused network: %v", err)
	}
	if nets, _ := h.st.ListNetworks(); len(nets) != 2 {
		t.Errorf("%d stored networks", len(nets))
	}
	if got := h.m.Refusals()[LimitNetworks]; got != 1 {
		t.Errorf("refusals counted: %d", got)
	}
	if err := h.m.nets.Delete("n1"); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.nets.Create(&hypervisorv1.CreateNetworkRequest{Name: "n3", Cidr: "10.3.0.0/24"}, "tester"); err != nil {
		t.Errorf("create after a delete: %v", err)
	}
}

// The IMDS looks its caller up on every request: the lookup copies no
// record, so its cost does not grow with the host's VMs (it cloned every
// record before). A deleted VM's address finds nothing.
func TestIMDSLookupCopiesNoRecords(t *testing.T) {
	h := newHarness(t)
	h.m.Close()
	const n = 200
	for i := range n {
		rec := &storepb.VirtualMachine{Id: fmt.Sprintf("0b%06x", i), Name: fmt.Sprintf("v%d", i), State: hypervisorv1.State_STATE_STOPPED,
			Network: "net", Ip: fmt.Sprintf("10.0.%d.%d", i/250, 2+i%250), Metadata: map[string]string{"k": "v"},
			Paths: &hypervisorv1.Paths{Dir: filepath.Join(h.dir, "vms", fmt.Sprintf("0b%06x", i))}}
		if err := h.st.PutVM(rec); err != nil {
			t.Fatal(err)
		}
	}
	h.start()
	view := h.m.Guest().Network("net")
	last := netip.MustParseAddr(fmt.Sprintf("10.0.%d.%d", (n-1)/250, 2+(n-1)%250))
	if vm, ok := view.ByIP(last); !ok || vm.GetId() != fmt.Sprintf("0b%06x", n-1) || vm.GetMetadata()["k"] != "v" {
		t.Fatalf("ByIP(%s) = %v, %v", last, vm, ok)
	}
	if _, ok := h.m.Guest().Network("other").ByIP(last); ok {
		t.Error("an address of another network matched")
	}
	if allocs := testing.AllocsPerRun(100, func() { view.ByIP(last) }); allocs > 5 {
		t.Errorf("ByIP allocates %.0f times among %d VMs; it must copy no record", allocs, n)
	}
	if err := h.m.Delete(context.Background(), fmt.Sprintf("0b%06x", n-1)); err != nil {
		t.Fatal(err)
	}
	if _, ok := view.ByIP(last); ok {
		t.Error("a deleted VM's address still matches")
	}
}
