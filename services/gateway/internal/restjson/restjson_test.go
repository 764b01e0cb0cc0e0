package restjson_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

func marshal(t *testing.T, m proto.Message) (string, map[string]any) {
	t.Helper()
	b, err := restjson.Marshal(m)
	if err != nil {
		t.Fatalf("Marshal: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var obj map[string]any
	if err := dec.Decode(&obj); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, b)
	}
	return string(b), obj
}

func TestMarshalVirtualMachine(t *testing.T) {
	created := time.Date(2025, 3, 4, 5, 6, 7, 0, time.UTC)
	vm := &hypervisorv1.VirtualMachine{
		Id:        "0a1b2c3d",
		Name:      "web",
		State:     hypervisorv1.State_STATE_READY,
		MemoryMib: 512,
		DiskGib:   20,
		MachineId: "ab",
		CreatedAt: timestamppb.New(created),
	}
	out, obj := marshal(t, vm)

	if got := obj["state"]; got != "ready" {
		t.Errorf("state = %#v, want \"ready\"", got)
	}
	if got, ok := obj["memoryMiB"].(json.Number); !ok || got.String() != "512" {
		t.Errorf("memoryMiB = %#v, want number 512", obj["memoryMiB"])
	}
	if got, ok := obj["diskGiB"].(json.Number); !ok || got.String() != "20" {
		t.Errorf("diskGiB = %#v", obj["diskGiB"])
	}
	if obj["machineID"] != "ab" {
		t.Errorf("machineID = %#v", obj["machineID"])
	}
	if got := obj["createdAt"]; got != "2025-03-04T05:06:07Z" {
		t.Errorf("createdAt = %#v", got)
	}
	if s, _ := obj["createdAt"].(string); s != "" {
		if _, err := time.Parse(time.RFC3339, s); err != nil {
			t.Errorf("createdAt is not RFC 3339: %v", err)
		}
	}
	for _, absent := range []string{"lastError", "last_error", "phase", "accelerator", "readyAt", "processes", "ip"} {
		if _, ok := obj[absent]; ok {
			t.Errorf("%s present: %#v", absent, obj[absent])
		}
	}
	// REQUIRED messages are written even when unset, as null.
	for _, null := range []string{"attestation", "paths"} {
		if v, ok := obj[null]; !ok || v != nil {
			t.Errorf("%s = %#v (present %v), want null", null, v, ok)
		}
	}
	if got, ok := obj["booted"]; !ok || got != false {
		t.Errorf("booted = %#v (present %v), want false", got, ok)
	}
	if got, ok := obj["requireAttestation"]; !ok || got != false {
		t.Errorf("requireAttestation = %#v", got)
	}
	if got, ok := obj["cpus"].(json.Number); !ok || got.String() != "0" {
		t.Errorf("cpus = %#v, want 0", obj["cpus"])
	}
	if !strings.Contains(out, `"sshAuthorizedKeys": []`) {
		t.Errorf("sshAuthorizedKeys not an empty array:\n%s", out)
	}
	if !strings.Contains(out, `"metadata": {}`) {
		t.Errorf("metadata not an empty object:\n%s", out)
	}
	if !strings.HasPrefix(out, "{\n  \"id\": \"0a1b2c3d\",\n  \"name\": \"web\",\n") {
		t.Errorf("not two-space indented in field order:\n%s", out)
	}
	if !strings.HasSuffix(out, "\n}\n") {
		t.Errorf("no trailing newline: %q", out[len(out)-5:])
	}
	if strings.Contains(out, "\t") {
		t.Errorf("tabs in output")
	}
}

func TestMarshalNestedAndTimestampNanos(t *testing.T) {
	vm := &hypervisorv1.VirtualMachine{
		State:     hypervisorv1.State_STATE_FAILED,
		LastError: "qemu exited",
		ReadyAt:   timestamppb.New(time.Date(2025, 1, 1, 0, 0, 0, 500_000_000, time.FixedZone("x", 3600))),
		Attestation: &attestationv1.Attestation{
			Required: true,
			Boot:     3,
		},
		SshAuthorizedKeys: []string{"ssh-ed25519 AAAA"},
	}
	out, obj := marshal(t, vm)
	if obj["state"] != "failed" || obj["lastError"] != "qemu exited" {
		t.Errorf("state/lastError = %#v %#v", obj["state"], obj["lastError"])
	}
	if obj["readyAt"] != "2024-12-31T23:00:00.5Z" {
		t.Errorf("readyAt = %#v, want UTC with fraction", obj["readyAt"])
	}
	att, ok := obj["attestation"].(map[string]any)
	if !ok {
		t.Fatalf("attestation = %#v", obj["attestation"])
	}
	if att["required"] != true || att["userDataReleased"] != false {
		t.Errorf("attestation = %#v", att)
	}
	if n, ok := att["boot"].(json.Number); !ok || n.String() != "3" {
		t.Errorf("attestation.boot = %#v, want number 3", att["boot"])
	}
	if _, ok := att["initrd"]; ok {
		t.Errorf("unset initrd quote present")
	}
	if !strings.Contains(out, "    \"required\": true") {
		t.Errorf("nested object not indented by four spaces:\n%s", out)
	}
	if keys, _ := obj["sshAuthorizedKeys"].([]any); len(keys) != 1 || keys[0] != "ssh-ed25519 AAAA" {
		t.Errorf("sshAuthorizedKeys = %#v", obj["sshAuthorizedKeys"])
	}
}

func TestMarshalInt64IsNumber(t *testing.T) {
	out, obj := marshal(t, &hypervisorv1.Host{MemoryBytes: 25276059648})
	if !strings.Contains(out, `"memoryBytes": 25276059648`) {
		t.Errorf("memoryBytes not a bare number:\n%s", out)
	}
	if n, ok := obj["memoryBytes"].(json.Number); !ok || n.String() != "25276059648" {
		t.Errorf("memoryBytes = %#v", obj["memoryBytes"])
	}
	// Enum zero (ACCELERATOR_UNSPECIFIED) is omitted.
	if _, ok := obj["accelerator"]; ok {
		t.Errorf("unspecified accelerator present: %#v", obj["accelerator"])
	}
	_, obj = marshal(t, &hypervisorv1.Host{Accelerator: hypervisorv1.Accelerator_ACCELERATOR_KVM})
	if obj["accelerator"] != "kvm" {
		t.Errorf("accelerator = %#v, want kvm", obj["accelerator"])
	}
}

func TestMarshalUint32MapKeysInNumericOrder(t *testing.T) {
	q := &attestationv1.Quote{
		Verified: true,
		Pcrs:     map[uint32]string{11: "bb", 0: "00", 7: "77"},
		Learned:  []uint32{7},
	}
	out, obj := marshal(t, q)
	i0 := strings.Index(out, `"0": "00"`)
	i7 := strings.Index(out, `"7": "77"`)
	i11 := strings.Index(out, `"11": "bb"`)
	if i0 < 0 || i7 < 0 || i11 < 0 {
		t.Fatalf("pcrs keys missing:\n%s", out)
	}
	if !(i0 < i7 && i7 < i11) {
		t.Errorf("pcrs keys not in numeric order (0 %d, 7 %d, 11 %d):\n%s", i0, i7, i11, out)
	}
	if l, _ := obj["learned"].([]any); len(l) != 1 || l[0].(json.Number).String() != "7" {
		t.Errorf("learned = %#v", obj["learned"])
	}
	if !strings.Contains(out, `"mismatchedEvents": []`) {
		t.Errorf("empty list not []:\n%s", out)
	}
}

func TestMarshalStructIsPlainObject(t *testing.T) {
	policy, err := structpb.NewStruct(map[string]any{
		"image_id": "flatcar",
		"pcr11":    map[string]any{"enter-initrd": "ab"},
		"n":        3,
	})
	if err != nil {
		t.Fatal(err)
	}
	_, obj := marshal(t, &hypervisorv1.Image{Id: "flatcar", Kind: hypervisorv1.ImageKind_IMAGE_KIND_UKI, Policy: policy})
	p, ok := obj["policy"].(map[string]any)
	if !ok {
		t.Fatalf("policy = %#v, want an object", obj["policy"])
	}
	if p["image_id"] != "flatcar" {
		t.Errorf("policy.image_id = %#v", p["image_id"])
	}
	if _, ok := p["fields"]; ok {
		t.Errorf("policy has Struct internals: %#v", p)
	}
	if inner, _ := p["pcr11"].(map[string]any); inner["enter-initrd"] != "ab" {
		t.Errorf("policy.pcr11 = %#v", p["pcr11"])
	}
	if n, _ := p["n"].(json.Number); n.String() != "3" {
		t.Errorf("policy.n = %#v", p["n"])
	}
	if obj["kind"] != "uki" {
		t.Errorf("kind = %#v", obj["kind"])
	}
}

func TestMarshalOptionalPresence(t *testing.T) {
	_, obj := marshal(t, &hypervisorv1.HostMetrics{State: hypervisorv1.State_STATE_RUNNING})
	for _, k := range []string{"pid", "cpu_seconds", "memory_rss_bytes", "install_seconds", "boot_to_ready_seconds"} {
		if _, ok := obj[k]; ok {
			t.Errorf("unset %s present: %#v", k, obj[k])
		}
	}
	for _, k := range []string{"network", "attestation"} { // REQUIRED, unset
		if v, ok := obj[k]; !ok || v != nil {
			t.Errorf("unset required %s = %#v (present %v), want null", k, v, ok)
		}
	}
	if n, ok := obj["disk_bytes"].(json.Number); !ok || n.String() != "0" {
		t.Errorf("disk_bytes = %#v, want 0 (no presence, always written)", obj["disk_bytes"])
	}
	if obj["state"] != "running" {
		t.Errorf("state = %#v", obj["state"])
	}

	out, obj := marshal(t, &hypervisorv1.HostMetrics{
		Pid:         proto.Int32(0),
		CpuSeconds:  proto.Float64(1.5),
		Attestation: hypervisorv1.AttestationState_ATTESTATION_STATE_RELEASED,
	})
	if n, ok := obj["pid"].(json.Number); !ok || n.String() != "0" {
		t.Errorf("pid set to 0 = %#v, want present 0", obj["pid"])
	}
	if n, ok := obj["cpu_seconds"].(json.Number); !ok || n.String() != "1.5" {
		t.Errorf("cpu_seconds = %#v\n%s", obj["cpu_seconds"], out)
	}
	if obj["attestation"] != "released" {
		t.Errorf("attestation = %#v", obj["attestation"])
	}
}

func TestUnmarshalCreateRequestSnakeCase(t *testing.T) {
	var req hypervisorv1.CreateVirtualMachineRequest
	body := `{"name":"a","memory_mib":512,"wait_for":"attested","require_attestation":false,"metadata":{"k":"v"},"ssh_authorized_keys":["k1"]}`
	if err := restjson.Unmarshal([]byte(body), &req); err != nil {
		t.Fatal(err)
	}
	if req.GetName() != "a" {
		t.Errorf("name = %q", req.GetName())
	}
	if req.MemoryMib == nil || *req.MemoryMib != 512 {
		t.Errorf("memory_mib = %v", req.MemoryMib)
	}
	if req.GetWaitFor() != hypervisorv1.WaitFor_WAIT_FOR_ATTESTED {
		t.Errorf("wait_for = %v", req.GetWaitFor())
	}
	if req.RequireAttestation == nil || *req.RequireAttestation {
		t.Errorf("require_attestation = %v, want pointer to false", req.RequireAttestation)
	}
	if req.Cpus != nil {
		t.Errorf("cpus = %v, want unset", *req.Cpus)
	}
	if len(req.GetMetadata()) != 1 || req.GetMetadata()["k"] != "v" {
		t.Errorf("metadata = %v", req.GetMetadata())
	}
	if len(req.GetSshAuthorizedKeys()) != 1 || req.GetSshAuthorizedKeys()[0] != "k1" {
		t.Errorf("ssh_authorized_keys = %v", req.GetSshAuthorizedKeys())
	}
}

func TestUnmarshalCamelCaseAndFullEnumName(t *testing.T) {
	var req hypervisorv1.CreateVirtualMachineRequest
	if err := restjson.Unmarshal([]byte(`{"name":"b","memoryMib":1024,"waitFor":"WAIT_FOR_READY","requireAttestation":true}`), &req); err != nil {
		t.Fatal(err)
	}
	if req.MemoryMib == nil || *req.MemoryMib != 1024 {
		t.Errorf("memoryMib = %v", req.MemoryMib)
	}
	if req.GetWaitFor() != hypervisorv1.WaitFor_WAIT_FOR_READY {
		t.Errorf("waitFor = %v", req.GetWaitFor())
	}
	if req.RequireAttestation == nil || !*req.RequireAttestation {
		t.Errorf("requireAttestation = %v", req.RequireAttestation)
	}
	for rest, want := range map[string]hypervisorv1.WaitFor{
		"none":      hypervisorv1.WaitFor_WAIT_FOR_NONE,
		"installed": hypervisorv1.WaitFor_WAIT_FOR_INSTALLED,
		"ready":     hypervisorv1.WaitFor_WAIT_FOR_READY,
	} {
		var r hypervisorv1.CreateVirtualMachineRequest
		if err := restjson.Unmarshal([]byte(`{"wait_for":"`+rest+`"}`), &r); err != nil {
			t.Errorf("wait_for %q: %v", rest, err)
		} else if r.GetWaitFor() != want {
			t.Errorf("wait_for %q = %v", rest, r.GetWaitFor())
		}
	}
}

func TestUnmarshalErrors(t *testing.T) {
	cases := []struct {
		name, body string
		want       []string
	}{
		{"unknown enum", `{"name":"a","wait_for":"soon"}`, []string{`"soon"`, "none, installed, attested, ready", "wait_for"}},
		{"unknown field", `{"name":"a","colour":"blue"}`, []string{"colour"}},
		{"trailing value", `{"name":"a"} {"name":"b"}`, []string{"unexpected data"}},
		{"trailing garbage", `{"name":"a"} x`, []string{"unexpected data"}},
		{"trailing brace", `{"name":"a"}}`, []string{"unexpected data"}},
		{"trailing bracket", `{"name":"a"}]`, []string{"unexpected data"}},
		{"wrong type", `{"name":5}`, []string{"name"}},
		{"not json", `{"name":`, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var req hypervisorv1.CreateVirtualMachineRequest
			err := restjson.Unmarshal([]byte(c.body), &req)
			if err == nil {
				t.Fatalf("Unmarshal(%s) succeeded: %v", c.body, &req)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
	// Trailing whitespace is fine.
	var req hypervisorv1.CreateVirtualMachineRequest
	if err := restjson.Unmarshal([]byte("{\"name\":\"a\"}\n\t "), &req); err != nil || req.GetName() != "a" {
		t.Errorf("trailing whitespace: %v", err)
	}
}

func TestMarshalerDecoder(t *testing.T) {
	var m restjson.Marshaler
	var req hypervisorv1.CreateVirtualMachineRequest
	for _, empty := range []string{"", "  \n"} {
		if err := m.NewDecoder(strings.NewReader(empty)).Decode(&req); !errors.Is(err, io.EOF) {
			t.Errorf("empty body %q: err = %v, want io.EOF", empty, err)
		}
	}
	err := m.NewDecoder(strings.NewReader(`{"name":"a","bogus":1}`)).Decode(&req)
	if err == nil || !strings.HasPrefix(err.Error(), "body: ") || !strings.Contains(err.Error(), "bogus") {
		t.Errorf("bad body: err = %v", err)
	}
	if err := m.NewDecoder(strings.NewReader(`{"name":"ok","wait_for":"none"}`)).Decode(&req); err != nil {
		t.Fatalf("good body: %v", err)
	}
	if req.GetName() != "ok" || req.GetWaitFor() != hypervisorv1.WaitFor_WAIT_FOR_NONE {
		t.Errorf("decoded %v", &req)
	}
	// Non-proto values go through encoding/json.
	var plain map[string]int
	if err := m.NewDecoder(strings.NewReader(`{"a":1}`)).Decode(&plain); err != nil || plain["a"] != 1 {
		t.Errorf("plain decode: %v %v", plain, err)
	}
}

func TestMarshalerEncoder(t *testing.T) {
	var m restjson.Marshaler
	if ct := m.ContentType(nil); ct != "application/json" {
		t.Errorf("ContentType = %q", ct)
	}
	// A slice of messages is an array in REST shape.
	b, err := m.Marshal([]*hypervisorv1.Image{{Id: "a"}, {Id: "b"}})
	if err != nil {
		t.Fatal(err)
	}
	var arr []map[string]any
	if err := json.Unmarshal(b, &arr); err != nil {
		t.Fatalf("%v\n%s", err, b)
	}
	if len(arr) != 2 || arr[0]["id"] != "a" || arr[1]["id"] != "b" {
		t.Errorf("array = %v", arr)
	}
	if !strings.HasPrefix(string(b), "[\n  {\n    \"id\": \"a\"") || !strings.HasSuffix(string(b), "]\n") {
		t.Errorf("array formatting:\n%s", b)
	}
	// An empty slice is [], not null.
	b, err = m.Marshal([]*hypervisorv1.Image{})
	if err != nil || strings.TrimSpace(string(b)) != "[]" {
		t.Errorf("empty slice = %q %v", b, err)
	}
	// Encoder writes exactly one value.
	var buf bytes.Buffer
	if err := m.NewEncoder(&buf).Encode(&hypervisorv1.VirtualMachine{State: hypervisorv1.State_STATE_STOPPED}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), `"state": "stopped"`) || !strings.HasSuffix(buf.String(), "}\n") {
		t.Errorf("encoded:\n%s", buf.String())
	}
	// Other values go through encoding/json, indented.
	b, err = m.Marshal(map[string]string{"error": "x"})
	if err != nil || string(b) != "{\n  \"error\": \"x\"\n}\n" {
		t.Errorf("plain = %q %v", b, err)
	}
}

func TestRoundTripThroughREST(t *testing.T) {
	// What Marshal writes for a request, Unmarshal reads back.
	in := &hypervisorv1.CreateVirtualMachineRequest{
		Name:               "rt",
		MemoryMib:          proto.Int32(2048),
		RequireAttestation: proto.Bool(false),
		WaitFor:            hypervisorv1.WaitFor_WAIT_FOR_INSTALLED,
		Metadata:           map[string]string{"a": "1"},
	}
	b, err := restjson.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	var out hypervisorv1.CreateVirtualMachineRequest
	if err := restjson.Unmarshal(b, &out); err != nil {
		t.Fatalf("%v\n%s", err, b)
	}
	if !proto.Equal(in, &out) {
		t.Errorf("round trip: %v != %v\n%s", in, &out, b)
	}
}
