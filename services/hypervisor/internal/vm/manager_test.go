package vm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/grpc"
)

// kernelImage is the one image the manager tests boot.
type kernelImage struct{}

var bootImage = &hypervisorv1.Image{Ref: "test_1", Id: "test", Version: "1", Kind: hypervisorv1.ImageKind_IMAGE_KIND_KERNEL, Kernel: "/k", Initrd: "/i"}

// installImage is a UKI image: its VMs boot the installer first.
var installImage = &hypervisorv1.Image{Ref: "os_1", Id: "os", Version: "1", Kind: hypervisorv1.ImageKind_IMAGE_KIND_UKI, Uki: "/u.efi", Disk: "/u.raw"}

func (kernelImage) Get(ref string) (*hypervisorv1.Image, error) {
	for _, img := range []*hypervisorv1.Image{bootImage, installImage} {
		if ref == img.GetRef() || ref == img.GetId() {
			return img, nil
		}
	}
	return nil, apierr.ErrNotFound
}
func (kernelImage) Default() (*hypervisorv1.Image, error) { return bootImage, nil }

// bootLog is an attestation service that counts boots and keeps the key
// each was registered with.
type bootLog struct {
	attestationv1.VerifierServiceClient
	mu      sync.Mutex
	boots   map[string]uint64
	keys    map[string][]byte
	forgot  []string
	started chan string
}

func newBootLog() *bootLog {
	return &bootLog{boots: map[string]uint64{}, keys: map[string][]byte{}, started: make(chan string, 16)}
}

func (b *bootLog) BeginBoot(_ context.Context, req *attestationv1.BeginBootRequest, _ ...grpc.CallOption) (*attestationv1.Attestation, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.boots[req.GetVmId()]++
	b.keys[req.GetVmId()] = req.GetAkPublic()
	return &attestationv1.Attestation{Required: req.GetRequired(), UserDataReleased: !req.GetRequired(), Boot: b.boots[req.GetVmId()]}, nil
}

func (b *bootLog) ForgetVirtualMachine(_ context.Context, req *attestationv1.ForgetVirtualMachineRequest, _ ...grpc.CallOption) (*attestationv1.ForgetVirtualMachineResponse, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.forgot = append(b.forgot, req.GetVmId())
	return &attestationv1.ForgetVirtualMachineResponse{}, nil
}

type harness struct {
	t      *testing.T
	limits Limits        // of the next start
	tweak  func(*Config) // changes the next start's configuration
	dir    string
	st     *vmstore.Store
	drv    *fakeDriver
	wrap   func(*fakeDriver) Driver // the driver the manager gets, when set
	att    *bootLog
	router *notify.Router
	pools  Pools // of the next start
	m      *testVMs
}

// newHarness is a manager over a real store, the fake driver, the fake
// attestation service and no network.
func newHarness(t *testing.T) *harness {
	t.Helper()
	dir := t.TempDir()
	st, err := vmstore.Open(filepath.Join(dir, "hypervisor.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	h := &harness{t: t, dir: dir, st: st, drv: newFakeDriver(), att: newBootLog(), router: notify.NewRouter()}
	h.start()
	return h
}

// start runs a (new) manager on the harness's store and driver.
func (h *harness) start() {
	h.t.Helper()
	cfg := Config{StateDir: h.dir, StopTimeout: 2 * time.Second, BootTimeout: time.Minute, KillGrace: time.Second, Limits: h.limits}
	if h.tweak != nil {
		h.tweak(&cfg)
	}
	var drv Driver = h.drv
	if h.wrap != nil {
		drv = h.wrap(h.drv)
	}
	m, err := assemble(cfg, slog.New(slog.DiscardHandler), h.st, kernelImage{}, h.att, h.router, drv, h.pools)
	if err != nil {
		h.t.Fatal(err)
	}
	h.m = m
	m.RunLoops()
	h.t.Cleanup(func() {
		m.Close()
		if n := m.IllegalTransitions(); n != 0 {
			h.t.Errorf("%d state changes refused by the lifecycle", n)
		}
	})
}

// ready delivers the guest's READY=1 once the VM's current boot listens.
func (h *harness) ready(id string) {
	h.t.Helper()
	h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_BOOTING })
	deadline := time.Now().Add(5 * time.Second)
	for {
		h.router.Deliver(notify.Delivery{VM: id, Msg: notify.Message{Ready: true}})
		if v, _ := h.m.Get(id); v.GetState() == hypervisorv1.State_STATE_READY {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("vm %s never became ready", id)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (h *harness) waitFor(id string, ok func(*hypervisorv1.VirtualMachine) bool) *hypervisorv1.VirtualMachine {
	h.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		v, err := h.m.Get(id)
		if err == nil && ok(v) {
			return v
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("vm %s: %v %v", id, v, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// create makes a VM and waits for it to be ready, delivering READY=1.
func (h *harness) create(name string) *hypervisorv1.VirtualMachine {
	h.t.Helper()
	type result struct {
		v   *hypervisorv1.VirtualMachine
		err error
	}
	res := make(chan result, 1)
	go func() {
		v, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: name, RequireAttestation: new(true), MemoryMib: new(int32(512)), Cpus: new(int32(1))}, "tester")
		res <- result{v, err}
	}()
	var id string
	deadline := time.Now().Add(5 * time.Second)
	for id == "" && time.Now().Before(deadline) {
		for _, v := range h.m.List() {
			if v.GetName() == name {
				id = v.GetId()
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	h.ready(id)
	r := <-res
	if r.err != nil {
		h.t.Fatalf("create %s: %v", name, r.err)
	}
	return r.v
}

func TestCreateBootsAndWaitsForReady(t *testing.T) {
	h := newHarness(t)
	v := h.create("web")
	if v.GetState() != hypervisorv1.State_STATE_READY || v.GetBootCount() != 1 || v.GetPhase() != hypervisorv1.Phase_PHASE_BOOT ||
		v.GetProcesses().GetQemu().GetPid() == 0 || v.GetReadyAt() == nil || v.GetCreatedBy() != "tester" {
		t.Fatalf("created: %v", v)
	}
	if v.GetAttestation().GetBoot() != 1 || v.GetAttestation().GetUserDataReleased() {
		t.Errorf("attestation of the first boot: %v", v.GetAttestation())
	}
	if h.drv.prepared != 1 || h.drv.provisioned != 1 || h.drv.launchCount() != 1 || h.drv.launches[0].Phase != hypervisorv1.Phase_PHASE_BOOT {
		t.Errorf("driver: prepared %d, provisioned %d, launches %v", h.drv.prepared, h.drv.provisioned, h.drv.launches)
	}
	if string(h.att.keys[v.GetId()]) != string(fakeAK(v.GetId())) {
		t.Errorf("the boot was registered with key %q", h.att.keys[v.GetId()])
	}
	if v.GetTpm().GetAkFingerprint() != vtpm.Fingerprint(fakeAK(v.GetId())) {
		t.Errorf("the record's vTPM identity: %v", v.GetTpm())
	}
	// The record is in the store, the API view has no internals.
	rec, err := h.st.GetVM(v.GetId())
	if err != nil || rec.GetProcesses().GetQemu().GetStartTicks() != 7 || string(rec.GetTpm().GetAkPublic()) != string(fakeAK(v.GetId())) {
		t.Errorf("stored record: %v %v", rec, err)
	}
	// A second VM of that name is refused; a launch failure leaves nothing.
	if _, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: "web"}, ""); apierr.CodeOf(err) != apierr.Conflict {
		t.Errorf("second web: %v", err)
	}
	h.drv.mu.Lock()
	h.drv.failLaunch = errors.New("qemu did not come up")
	h.drv.mu.Unlock()
	if _, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: "broken"}, ""); apierr.CodeOf(err) != apierr.VMFailed {
		t.Errorf("create with a failing launch: %v", err)
	}
	if got := len(h.m.List()); got != 1 {
		t.Errorf("%d vms after a failed create, want 1", got)
	}
}

func TestStopStartReboot(t *testing.T) {
	h := newHarness(t)
	v := h.create("web")
	id := v.GetId()
	first := h.drv.run(id)
	if v, err := h.m.Stop(context.Background(), id); err != nil || v.GetState() != hypervisorv1.State_STATE_STOPPED || v.GetProcesses() != nil {
		t.Fatalf("stop: %v %v", v, err)
	}
	if !first.reaped {
		t.Error("the stopped run was not reaped")
	}
	if _, err := h.m.Stop(context.Background(), id); apierr.CodeOf(err) != apierr.Conflict {
		t.Errorf("stop of a stopped vm: %v", err)
	}
	v, err := h.m.Start(context.Background(), id)
	if err != nil || v.GetState() != hypervisorv1.State_STATE_BOOTING || v.GetBootCount() != 2 {
		t.Fatalf("start: %v %v", v, err)
	}
	h.ready(id)
	if _, err := h.m.Start(context.Background(), id); apierr.CodeOf(err) != apierr.Conflict {
		t.Errorf("start of a running vm: %v", err)
	}
	v, err = h.m.Reboot(context.Background(), id)
	if err != nil || v.GetState() != hypervisorv1.State_STATE_BOOTING || v.GetBootCount() != 3 || v.GetAttestation().GetBoot() != 3 {
		t.Fatalf("reboot: %v %v", v, err)
	}
	if h.drv.launchCount() != 3 || h.drv.provisioned != 3 {
		t.Errorf("launches %d, provisionings %d, want 3 each", h.drv.launchCount(), h.drv.provisioned)
	}
	// A guest that ignores the power button is terminated after the stop timeout.
	h.ready(id)
	h.drv.run(id).mu.Lock()
	h.drv.run(id).deaf = true
	h.drv.run(id).mu.Unlock()
	if v, err := h.m.Stop(context.Background(), id); err != nil || v.GetState() != hypervisorv1.State_STATE_STOPPED {
		t.Fatalf("stop of a deaf guest: %v %v", v, err)
	}
}

func TestDelete(t *testing.T) {
	h := newHarness(t)
	v := h.create("web")
	id := v.GetId()
	if err := h.m.Delete(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.Get(id); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("get after delete: %v", err)
	}
	if _, err := os.Stat(filepath.Join(h.dir, "vms", id)); !os.IsNotExist(err) {
		t.Errorf("vm directory after delete: %v", err)
	}
	if _, err := h.st.GetVM(id); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("record after delete: %v", err)
	}
	select {
	case <-h.drv.run(id).Done():
	default:
		t.Error("the deleted vm's run still runs")
	}
	h.att.mu.Lock()
	forgot := slices.Clone(h.att.forgot)
	h.att.mu.Unlock()
	if !slices.Equal(forgot, []string{id}) {
		t.Errorf("attestation forgot %v", forgot)
	}
	if err := h.m.Delete(context.Background(), id); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("second delete: %v", err)
	}
}

// A restarted hypervisor adopts the VMs whose processes still run (their
// supervision resumes), stops those whose processes are gone and fails
// those caught in creating; strays of no record are ended.
func TestRestartAdopts(t *testing.T) {
	h := newHarness(t)
	alive, dead := h.create("alive"), h.create("dead")
	h.m.Close()
	if !h.drv.run(alive.GetId()).detached {
		t.Fatal("Close did not leave the run for the next hypervisor")
	}
	h.drv.mu.Lock()
	h.drv.gone[dead.GetId()] = true
	h.drv.strays = map[string][]Stray{"0f0f0f0f": {{PID: 4242, Binary: "swtpm"}}, alive.GetId(): {{PID: int(alive.GetProcesses().GetQemu().GetPid()), Binary: "qemu"}}}
	h.drv.mu.Unlock()

	h.start()
	v, err := h.m.Get(alive.GetId())
	if err != nil || v.GetState() != hypervisorv1.State_STATE_READY || v.GetProcesses().GetQemu().GetPid() != alive.GetProcesses().GetQemu().GetPid() {
		t.Errorf("adopted: %v %v", v, err)
	}
	if v, _ := h.m.Get(dead.GetId()); v.GetState() != hypervisorv1.State_STATE_STOPPED || v.GetLastError() == "" || v.GetProcesses() != nil {
		t.Errorf("vm whose processes are gone: %v", v)
	}
	if len(h.drv.ended) != 1 || h.drv.ended[0].PID != 4242 {
		t.Errorf("strays ended: %v (the adopted qemu must stay)", h.drv.ended)
	}
	// The adopted VM is supervised: a stop works.
	if v, err := h.m.Stop(context.Background(), alive.GetId()); err != nil || v.GetState() != hypervisorv1.State_STATE_STOPPED {
		t.Errorf("stop of an adopted vm: %v %v", v, err)
	}
}

// A reset inside the guest is a new boot: registered again, gate closed
// until then, counted; a boot loop fails the VM.
func TestGuestResetIsANewBoot(t *testing.T) {
	h := newHarness(t)
	v := h.create("web")
	id := v.GetId()
	h.drv.run(id).reset()
	v = h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool { return v.GetBootCount() == 2 })
	if v.GetState() != hypervisorv1.State_STATE_BOOTING || v.GetAttestation().GetBoot() != 2 || v.GetAttestation().GetUserDataReleased() || v.GetReadyAt() != nil {
		t.Fatalf("after a reset: %v", v)
	}
	if h.drv.launchCount() != 2 || h.drv.provisioned != 2 {
		t.Errorf("launches %d, provisionings %d", h.drv.launchCount(), h.drv.provisioned)
	}
	for i := range MaxGuestResets {
		h.ready(id)
		h.drv.run(id).reset()
		want := uint32(3 + i)
		if i < MaxGuestResets-1 {
			h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool { return v.GetBootCount() == want })
		}
	}
	v = h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_FAILED })
	if want := fmt.Sprintf("the guest reset %d times", MaxGuestResets+1); len(v.GetLastError()) < len(want) || v.GetLastError()[:len(want)] != want {
		t.Errorf("boot loop: %q", v.GetLastError())
	}
	// A start begins the count afresh.
	if _, err := h.m.Start(context.Background(), id); err != nil {
		t.Fatalf("start after a boot loop: %v", err)
	}
	h.ready(id)
	h.drv.run(id).reset()
	h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_BOOTING })
}

// A guest that powers off before it was ready (an initrd giving up, as
// vm-base's does on a dm-verity error) is stopped with its console's tail.
func TestGuestPowerOffBeforeReady(t *testing.T) {
	h := newHarness(t)
	v, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: "early", RequireAttestation: new(true),
		MemoryMib: new(int32(512)), Cpus: new(int32(1)), WaitFor: hypervisorv1.WaitFor_WAIT_FOR_NONE}, "tester")
	if err != nil {
		t.Fatal(err)
	}
	v = h.waitFor(v.GetId(), func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_BOOTING })
	if err := os.WriteFile(v.GetPaths().GetConsole(), []byte("device-mapper: verity: 252:0: data block 0 is corrupted\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := h.drv.run(v.GetId())
	r.shutdowns <- Shutdown{Guest: true}
	r.exit(0)
	v = h.waitFor(v.GetId(), func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_STOPPED })
	if !strings.HasPrefix(v.GetLastError(), "the guest powered off before it was ready") || !strings.Contains(v.GetLastError(), "data block 0 is corrupted") {
		t.Errorf("lastError %q", v.GetLastError())
	}
}

// A guest that powers itself off leaves the VM stopped, saying so.
func TestGuestPowerOff(t *testing.T) {
	h := newHarness(t)
	v := h.create("web")
	r := h.drv.run(v.GetId())
	r.shutdowns <- Shutdown{Guest: true}
	r.exit(0)
	v = h.waitFor(v.GetId(), func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_STOPPED })
	if v.GetLastError() != "guest shut down" {
		t.Errorf("lastError %q", v.GetLastError())
	}
	// A crash is a failure with the exit status.
	if _, err := h.m.Start(context.Background(), v.GetId()); err != nil {
		t.Fatal(err)
	}
	h.drv.run(v.GetId()).exit(1)
	v = h.waitFor(v.GetId(), func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_FAILED })
	if v.GetLastError() != "qemu exited: exit status 1" {
		t.Errorf("lastError %q", v.GetLastError())
	}
}

// Every change is an event, numbered; a create's states come in order, and
// a delete ends them. A change the lifecycle does not allow is refused.
func TestEvents(t *testing.T) {
	h := newHarness(t)
	sub, err := h.m.Events().Subscribe(0, 64)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Cancel()
	events := sub.C()
	v := h.create("web")
	if err := h.m.Delete(context.Background(), v.GetId()); err != nil {
		t.Fatal(err)
	}
	var states []hypervisorv1.State
	var last uint64
	deleted := false
	for !deleted {
		select {
		case e := <-events:
			if e.VMID != v.GetId() || e.Revision <= last {
				t.Fatalf("event %+v after revision %d", e, last)
			}
			last, deleted = e.Revision, e.Deleted
			if len(states) == 0 || states[len(states)-1] != e.To {
				states = append(states, e.To)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no deletion event; states %v", states)
		}
	}
	want := []hypervisorv1.State{hypervisorv1.State_STATE_CREATING, hypervisorv1.State_STATE_BOOTING, hypervisorv1.State_STATE_READY,
		hypervisorv1.State_STATE_DELETING}
	if !slices.Equal(states, want) {
		t.Errorf("states %v, want %v", states, want)
	}

	// A bug asking for stopped → ready is refused, and nothing changes.
	w := h.create("other")
	if _, err := h.m.Stop(context.Background(), w.GetId()); err != nil {
		t.Fatal(err)
	}
	if err := h.m.Update(w.GetId(), func(r *storepb.VirtualMachine) { r.State, r.Status = hypervisorv1.State_STATE_READY, "x" }); err != nil {
		t.Fatal(err)
	}
	if got, _ := h.m.Get(w.GetId()); got.GetState() != hypervisorv1.State_STATE_STOPPED || got.GetStatus() == "x" || h.m.IllegalTransitions() != 1 {
		t.Errorf("after an illegal change: %v, refused %d", got, h.m.IllegalTransitions())
	}
	h.m.illegal.Store(0) // seen
}
