package restjson_test

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
	"unicode/utf8"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// FuzzRESTBody feeds arbitrary request bodies to the REST decoder the gateway
// uses for POST /api/v1/vms and POST /api/v1/networks. Each body is either
// an error or a message; a message holds only valid UTF-8 and survives a
// round trip through the REST encoding unchanged.
func FuzzRESTBody(f *testing.F) {
	for _, s := range []string{
		// create_vm as the README and the MCP tool send it
		`{"name":"t1","require_attestation":false,"memory_mib":512,"cpus":1}`,
		`{"name":"web","image":"giantswarm-vm-base_0.2.0","kubernetes_version":"v1.33.1","cpus":2,"memory_mib":2048,"disk_gib":20,` +
			`"network":"default","user_data":"{\"ignition\":{\"version\":\"3.4.0\"}}","ssh_authorized_keys":["ssh-ed25519 AAAA user@host"],` +
			`"hostname":"web-1","metadata":{"role":"worker","empty":""},"require_attestation":true,"wait_for":"attested"}`,
		`{"name":"x","waitFor":"WAIT_FOR_READY","memoryMib":256,"diskGib":1,"sshAuthorizedKeys":[],"requireAttestation":null}`,
		`{"name":"x","wait_for":"never"}`,
		`{"name":"x","cpus":"4","memory_mib":1e3}`,
		`{"name":"x","metadata":{"a/b":"c","..":"d","a\u0000b":"e"}}`,
		`{"name":"x","unknown":1}`,
		// create_network
		`{"name":"net-a","cidr":"10.50.0.0/24","dns_search_domain":"example.com"}`,
		`{"name":"locked","cidr":"10.50.0.0/24","egress":[{"cidr":"10.0.0.0/8","ports":[443]},{"cidr":"93.184.0.0/16"}]}`,
		`{"name":"n","cidr":"10.0.0.0/16","egress":[{"cidr":"1.2.3.0/24","ports":[-1,65536,"80"]}]}`,
		// hostile shapes
		strings.Repeat("[", 64),
		strings.Repeat(`{"metadata":`, 32),
		"{\"name\":\"\xff\xfe\"}",
		`{"name":"\ud800"}`,
		`{"name":"a"} {"name":"b"}`,
		`{"name":"a","name":"b"}`,
		`[]`, `null`, `""`, `0`, ``, ` `,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		check(t, body, &hypervisorv1.CreateVirtualMachineRequest{})
		check(t, body, &hypervisorv1.CreateNetworkRequest{})
	})
}

func check(t *testing.T, body []byte, m proto.Message) {
	dec := restjson.Marshaler{}.NewDecoder(bytes.NewReader(body))
	err := dec.Decode(m)
	if errors.Is(err, io.EOF) {
		if len(bytes.TrimSpace(body)) != 0 {
			t.Fatalf("io.EOF for a non-empty body %q", body)
		}
		return
	}
	if err != nil {
		if !strings.HasPrefix(err.Error(), "body: ") {
			t.Fatalf("error %q lacks the body: prefix", err)
		}
		return
	}
	if !utf8.Valid(body) {
		t.Fatalf("accepted invalid UTF-8 %q as %v", body, m)
	}
	validStrings(t, m.ProtoReflect())
	out, err := restjson.Marshal(m)
	if err != nil {
		t.Fatalf("Marshal(%v): %v", m, err)
	}
	again := m.ProtoReflect().New().Interface()
	if err := restjson.Unmarshal(out, again); err != nil {
		t.Fatalf("the REST encoding of %v does not decode: %v\n%s", m, err, out)
	}
	if !proto.Equal(m, again) {
		t.Fatalf("round trip changed the message:\n%v\n%v\n%s", m, again, out)
	}
}

// validStrings fails when any string in m is not valid UTF-8.
func validStrings(t *testing.T, m protoreflect.Message) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList():
			for i := 0; i < v.List().Len(); i++ {
				validValue(t, fd, v.List().Get(i))
			}
		case fd.IsMap():
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				if !utf8.ValidString(k.String()) {
					t.Fatalf("map key %q is not UTF-8", k.String())
				}
				validValue(t, fd.MapValue(), mv)
				return true
			})
		default:
			validValue(t, fd, v)
		}
		return true
	})
}

func validValue(t *testing.T, fd protoreflect.FieldDescriptor, v protoreflect.Value) {
	switch fd.Kind() {
	case protoreflect.StringKind:
		if !utf8.ValidString(v.String()) {
			t.Fatalf("%s %q is not UTF-8", fd.FullName(), v.String())
		}
	case protoreflect.MessageKind:
		validStrings(t, v.Message())
	}
}

// Found by FuzzRESTBody: encoding/json replaced invalid UTF-8 with U+FFFD,
// so a name with raw 0xff bytes was accepted (and changed) instead of refused.
func TestUnmarshalRejectsInvalidUTF8(t *testing.T) {
	for _, body := range []string{
		"{\"name\":\"a\xff\xfe\"}",
		"{\"name\":\"x\",\"metadata\":{\"k\xc3\":\"v\"}}",
		"{\"name\":\"x\",\"user_data\":\"\xed\xa0\x80\"}", // an encoded surrogate
	} {
		err := restjson.Unmarshal([]byte(body), &hypervisorv1.CreateVirtualMachineRequest{})
		if err == nil || !strings.Contains(err.Error(), "UTF-8") {
			t.Errorf("%q: err = %v, want an invalid UTF-8 error", body, err)
		}
	}
	var m hypervisorv1.CreateVirtualMachineRequest
	if err := restjson.Unmarshal([]byte(`{"name":"é✓"}`), &m); err != nil || m.GetName() != "é✓" {
		t.Fatalf("valid UTF-8: %v %q", err, m.GetName())
	}
}

// Found by FuzzRESTBody: map keys were quoted with strconv.Quote, whose \x00
// escapes are not JSON, so one VM with a control character in a metadata key
// made every get_vm and list_vms answer fail.
func TestMarshalMapKeysAreJSONStrings(t *testing.T) {
	vm := &hypervisorv1.VirtualMachine{Id: "0a1b2c3d", Metadata: map[string]string{"a\x00b": "1", "c\x7fd": "2", "é\u2028": "3"}}
	out, err := restjson.Marshal(vm)
	if err != nil {
		t.Fatalf("Marshal: %v", err)
	}
	var back hypervisorv1.VirtualMachine
	if err := restjson.Unmarshal(out, &back); err != nil {
		t.Fatalf("Unmarshal: %v\n%s", err, out)
	}
	if !proto.Equal(vm, &back) {
		t.Fatalf("round trip: %v != %v", vm, &back)
	}
}
