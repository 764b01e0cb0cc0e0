package restjson_test

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// The keys the original always writes, per response: each must be present in
// the output of an empty message, with its empty value. The list is the
// original's (contract §1.4), written out here so the test does not read the
// annotations it checks.
var alwaysWritten = []struct {
	msg  proto.Message
	keys map[string]string // key -> its compact JSON when the message is empty
}{
	{&hypervisorv1.GetVirtualMachineConsoleResponse{}, map[string]string{"id": `""`, "lines": `0`, "console": `""`}},
	{&hypervisorv1.ExecVirtualMachineResponse{}, map[string]string{"stdout": `""`, "stderr": `""`, "exitCode": `0`}},
	{&hypervisorv1.ForwardVirtualMachinePortResponse{}, map[string]string{"id": `""`, "port": `0`, "address": `""`}},
	{&hypervisorv1.Host{}, map[string]string{
		"hostname": `""`, "kernel": `""`, "cpus": `0`, "memoryBytes": `0`, "kvm": `null`, "vhostVsock": `null`,
		"qemu": `null`, "swtpm": `null`, "systemd": `null`, "storageProviders": `[]`, "ready": `false`,
	}},
	{&hypervisorv1.Device{}, map[string]string{"path": `""`, "accessible": `false`}},
	{&hypervisorv1.Tool{}, map[string]string{"found": `false`}},
	{&hypervisorv1.Image{}, map[string]string{"id": `""`, "version": `""`, "uki": `""`, "disk": `""`}},
	{&hypervisorv1.Network{}, map[string]string{"spec": `null`, "gateway": `""`, "leases": `[]`}},
	{&hypervisorv1.NetworkSpec{}, map[string]string{"name": `""`, "cidr": `""`, "enableIMDS": `false`}},
	{&hypervisorv1.Lease{}, map[string]string{"vmID": `""`, "mac": `""`, "ip": `""`}},
	{&hypervisorv1.VirtualMachine{}, map[string]string{
		"id": `""`, "name": `""`, "image": `""`, "cpus": `0`, "memoryMiB": `0`, "diskGiB": `0`, "network": `""`,
		"requireAttestation": `false`, "state": `null`, "cid": `0`, "machineID": `""`, "booted": `false`,
		"sshPublicKey": `""`, "attestation": `null`, "createdAt": `null`, "paths": `null`,
	}},
	{&attestationv1.Attestation{}, map[string]string{"required": `false`, "userDataReleased": `false`}},
	{&attestationv1.Quote{}, map[string]string{"verified": `false`, "at": `null`}},
	{&hypervisorv1.VirtualMachineMetrics{}, map[string]string{"id": `""`, "host": `null`, "guest": `null`}},
	{&hypervisorv1.HostMetrics{}, map[string]string{"state": `null`, "attestation": `null`, "disk_bytes": `0`, "network": `null`}},
	{&hypervisorv1.NetworkMetrics{}, map[string]string{"name": `""`, "bytes_sent": `0`, "bytes_received": `0`, "leases": `0`}},
	{&hypervisorv1.GuestMetrics{}, map[string]string{
		"received_at": `null`, "report_age_seconds": `0`, "families": `0`, "series": `0`,
		"series_exported": `0`, "series_dropped": `0`, "sample": `[]`,
	}},
	{&hypervisorv1.MetricSample{}, map[string]string{"name": `""`, "value": `null`}},
}

func TestAlwaysWrittenKeys(t *testing.T) {
	for _, c := range alwaysWritten {
		name := c.msg.ProtoReflect().Descriptor().Name()
		b, err := restjson.Marshal(c.msg)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got := compactKeys(t, b)
		for k, want := range c.keys {
			if v, ok := got[k]; !ok {
				t.Errorf("%s: %q missing from an empty message: %s", name, k, b)
			} else if v != want {
				t.Errorf("%s: %q = %s, want %s", name, k, v, want)
			}
		}
	}
}

// TestMetricsGuestNull is the original's "guest": null before the first
// upload, and an object after it.
func TestMetricsGuestNull(t *testing.T) {
	m := &hypervisorv1.VirtualMachineMetrics{Id: "0a1b2c3d", Host: &hypervisorv1.HostMetrics{State: hypervisorv1.State_STATE_READY}}
	b, err := restjson.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"guest": null`) {
		t.Errorf("no \"guest\": null before the first upload:\n%s", b)
	}
	m.Guest = &hypervisorv1.GuestMetrics{Families: 2}
	b, _ = restjson.Marshal(m)
	if got := compactKeys(t, b)["guest"]; !strings.HasPrefix(got, `{"received_at":null,`) {
		t.Errorf("guest after an upload = %s", got)
	}
}

// TestRequiredOnlyWhereTheOriginalRequires keeps the rule honest the other
// way round: a field the original leaves out when empty (it is optional in
// its schema) is still left out, so a client generated from it sees no new
// always-present keys, and the annotation is on exactly the listed fields.
func TestRequiredOnlyWhereTheOriginalRequires(t *testing.T) {
	for _, c := range alwaysWritten {
		md := c.msg.ProtoReflect().Descriptor()
		for i := 0; i < md.Fields().Len(); i++ {
			fd := md.Fields().Get(i)
			_, listed := c.keys[fd.JSONName()]
			if restjson.Required(fd) != listed {
				t.Errorf("%s: REQUIRED is %v, the original's list says %v", fd.FullName(), restjson.Required(fd), listed)
			}
		}
	}
	b, _ := restjson.Marshal(&hypervisorv1.VirtualMachine{Id: "0a1b2c3d"})
	for _, k := range []string{"kubernetesVersion", "hostname", "status", "lastError", "ip", "mac", "phase", "readyAt"} {
		if _, ok := compactKeys(t, b)[k]; ok {
			t.Errorf("VirtualMachine: empty optional %q written: %s", k, b)
		}
	}
}

// ownRequired are REQUIRED fields of responses the original does not have:
// our additions, always written.
var ownRequired = map[protoreflect.FullName]bool{
	"vmmanager.attestation.v1.ImagePolicy.document": true,
	// A watch message always says what it is and at which revision.
	"vmmanager.hypervisor.v1.WatchVirtualMachinesResponse.type":     true,
	"vmmanager.hypervisor.v1.WatchVirtualMachinesResponse.revision": true,
	// An import's progress always says its phase.
	"vmmanager.hypervisor.v1.ImportImageResponse.phase": true,
	// ExecVirtualMachineStream's parts: a start's and a resize's fields
	// are the caller's to give, an exit's code is always written.
	"vmmanager.hypervisor.v1.ExecStart.id":        true,
	"vmmanager.hypervisor.v1.ExecWindowSize.rows": true,
	"vmmanager.hypervisor.v1.ExecWindowSize.cols": true,
	"vmmanager.hypervisor.v1.ExecExit.exit_code":  true,
}

// TestRequiredOutsideTheListIsRequests: the annotation outside the response
// messages above marks only request fields, which the caller must give, and
// our own additions.
func TestRequiredOutsideTheListIsRequests(t *testing.T) {
	listed := map[protoreflect.FullName]bool{}
	for _, c := range alwaysWritten {
		listed[c.msg.ProtoReflect().Descriptor().FullName()] = true
	}
	for _, pkg := range []protoreflect.FullName{"vmmanager.hypervisor.v1", "vmmanager.attestation.v1"} {
		protoregistry.GlobalFiles.RangeFilesByPackage(pkg, func(f protoreflect.FileDescriptor) bool {
			for i := 0; i < f.Messages().Len(); i++ {
				md := f.Messages().Get(i)
				if listed[md.FullName()] || strings.HasSuffix(string(md.Name()), "Request") {
					continue
				}
				for j := 0; j < md.Fields().Len(); j++ {
					if fd := md.Fields().Get(j); restjson.Required(fd) && !ownRequired[fd.FullName()] {
						t.Errorf("%s is REQUIRED but neither a request field nor in the original's list", fd.FullName())
					}
				}
			}
			return true
		})
	}
}

// TestEmptyEnumIsTheDefault: "wait_for": "" asks for the default, as in the
// original, rather than being refused; other strings are still checked.
func TestEmptyEnumIsTheDefault(t *testing.T) {
	var req hypervisorv1.CreateVirtualMachineRequest
	if err := restjson.Unmarshal([]byte(`{"name":"a","wait_for":"","cpus":0}`), &req); err != nil {
		t.Fatalf("wait_for \"\": %v", err)
	}
	if req.GetWaitFor() != hypervisorv1.WaitFor_WAIT_FOR_UNSPECIFIED || req.Cpus == nil || *req.Cpus != 0 {
		t.Errorf("decoded %v", &req)
	}
	if err := restjson.Unmarshal([]byte(`{"name":"a","wait_for":"soon"}`), &req); err == nil || !strings.Contains(err.Error(), "none, installed, attested, ready") {
		t.Errorf("wait_for \"soon\": %v, want the list of values", err)
	}
}

// compactKeys is the top-level keys of a JSON object, each with its value as
// compact JSON.
func compactKeys(t *testing.T, b []byte) map[string]string {
	t.Helper()
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatalf("not a JSON object: %v\n%s", err, b)
	}
	out := make(map[string]string, len(raw))
	for k, v := range raw {
		var c bytes.Buffer
		if err := json.Compact(&c, v); err != nil {
			t.Fatal(err)
		}
		out[k] = c.String()
	}
	return out
}

// BenchmarkMarshalVirtualMachine is a full VM record through the REST
// codec: what the emit rule (a cached annotation look-up per field) costs.
func BenchmarkMarshalVirtualMachine(b *testing.B) {
	vm := &hypervisorv1.VirtualMachine{
		Id: "0a1b2c3d", Name: "web", Image: "test-guest_0.1.0", Cpus: 2, MemoryMib: 2048, DiskGib: 20, Network: "default",
		State: hypervisorv1.State_STATE_READY, Phase: hypervisorv1.Phase_PHASE_BOOT, Ip: "192.168.127.2", Cid: 3,
		MachineId: "0123456789abcdef0123456789abcdef", Booted: true, SshPublicKey: "ssh-ed25519 AAAA",
		Attestation: &attestationv1.Attestation{Required: true, UserDataReleased: true, Initrd: &attestationv1.Quote{Verified: true}},
		Paths:       &hypervisorv1.Paths{Dir: "/var/lib/vm-manager/vms/0a1b2c3d", Console: "console.log"},
		Metadata:    map[string]string{"role": "worker"},
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := restjson.Marshal(vm); err != nil {
			b.Fatal(err)
		}
	}
}
