package vm

import (
	"fmt"
	"os"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/sdk/defaults"
	"google.golang.org/protobuf/proto"
)

// images is a catalog port with one image offering two Kubernetes versions.
type images struct{}

var testImage = &hypervisorv1.Image{Ref: "test-guest_0.1.0", Kind: hypervisorv1.ImageKind_IMAGE_KIND_KERNEL, KubernetesVersions: []string{"v1.34.0", "v1.33.1"}}

func (images) Get(ref string) (*hypervisorv1.Image, error) {
	if ref == "test-guest" || ref == testImage.Ref {
		return testImage, nil
	}
	return nil, apierr.Errorf(apierr.NotFound, "image %q not found", ref)
}

func (images) Default() (*hypervisorv1.Image, error) { return testImage, nil }

func TestValidateDefaults(t *testing.T) {
	r, err := validate(&hypervisorv1.CreateVirtualMachineRequest{Name: "t1"}, images{}, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if r.hostname != "t1" || r.cpus != 2 || r.memoryMiB != 2048 || r.diskGiB != 20 || r.image != testImage ||
		r.kubernetesVersion != "v1.34.0" || r.waitFor != hypervisorv1.WaitFor_WAIT_FOR_READY || !r.requireAttestation {
		t.Errorf("defaults: %+v", r)
	}
}

// TestValidateZeroIsDefault: as in the original, 0 for a size and an
// unspecified wait_for (REST's and MCP's "") take the defaults.
func TestValidateZeroIsDefault(t *testing.T) {
	zero := proto.Int32(0)
	r, err := validate(&hypervisorv1.CreateVirtualMachineRequest{Name: "t1", Cpus: zero, MemoryMib: zero, DiskGib: zero,
		WaitFor: hypervisorv1.WaitFor_WAIT_FOR_UNSPECIFIED}, images{}, testLimits)
	if err != nil {
		t.Fatal(err)
	}
	if r.cpus != defaults.CPUs || r.memoryMiB != defaults.MemoryMiB || r.diskGiB != defaults.DiskGiB ||
		r.waitFor != hypervisorv1.WaitFor_WAIT_FOR_READY {
		t.Errorf("zero values gave cpus %d, memory_mib %d, disk_gib %d, wait_for %v", r.cpus, r.memoryMiB, r.diskGiB, r.waitFor)
	}
}

func TestValidateRejects(t *testing.T) {
	no := proto.Bool(false)
	cases := []struct {
		name string
		req  *hypervisorv1.CreateVirtualMachineRequest
		code apierr.Code
		want string
	}{
		{"empty name", &hypervisorv1.CreateVirtualMachineRequest{RequireAttestation: no}, apierr.InvalidRequest, "name"},
		{"upper case", &hypervisorv1.CreateVirtualMachineRequest{Name: "T1", RequireAttestation: no}, apierr.InvalidRequest, "DNS label"},
		{"64 chars", &hypervisorv1.CreateVirtualMachineRequest{Name: strings.Repeat("a", 64), RequireAttestation: no}, apierr.InvalidRequest, "DNS label"},
		{"trailing dash", &hypervisorv1.CreateVirtualMachineRequest{Name: "a-", RequireAttestation: no}, apierr.InvalidRequest, "DNS label"},
		{"bad hostname", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Hostname: "a.b", RequireAttestation: no}, apierr.InvalidRequest, "hostname"},
		{"unknown image", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Image: "nope", RequireAttestation: no}, apierr.InvalidRequest, "unknown image"},
		{"kubernetes", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", KubernetesVersion: "v1.0.0", RequireAttestation: no}, apierr.InvalidRequest, "available: v1.34.0, v1.33.1"},
		{"cpus -1", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Cpus: proto.Int32(-1), RequireAttestation: no}, apierr.InvalidRequest, "cpus -1 is not within 1..256"},
		{"cpus 257", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Cpus: proto.Int32(257), RequireAttestation: no}, apierr.InvalidRequest, "1..256"},
		{"memory", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", MemoryMib: proto.Int32(255), RequireAttestation: no}, apierr.InvalidRequest, "256"},
		{"memory -1", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", MemoryMib: proto.Int32(-1), RequireAttestation: no}, apierr.InvalidRequest, "memory_mib -1 is below 256"},
		{"disk -1", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", DiskGib: proto.Int32(-1), RequireAttestation: no}, apierr.InvalidRequest, "disk_gib -1 is not within 1..4096"},
		{"disk 4097", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", DiskGib: proto.Int32(4097), RequireAttestation: no}, apierr.InvalidRequest, "1..4096"},
		{"ssh key lines", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", SshAuthorizedKeys: []string{"a\nb"}, RequireAttestation: no}, apierr.InvalidRequest, "one non-empty line"},
		{"ssh keys count", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", SshAuthorizedKeys: sshKeys(MaxSSHKeys+1, 80), RequireAttestation: no}, apierr.InvalidRequest, "at most 32 ssh_authorized_keys, got 33"},
		{"ssh key size", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", SshAuthorizedKeys: append(sshKeys(1, 80), sshKeys(1, MaxSSHKeyBytes+1)...), RequireAttestation: no}, apierr.InvalidRequest, "ssh_authorized_keys[1] is 8193 bytes, at most 8192"},
		{"memory over the host's", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", MemoryMib: proto.Int32(4097), RequireAttestation: no}, apierr.InvalidRequest, "memory_mib 4097 is above this host's maximum of 4096 (--max-memory-mib)"},
		{"cpus over the host's", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Cpus: proto.Int32(5), RequireAttestation: no}, apierr.InvalidRequest, "cpus 5 is above this host's maximum of 4 (--max-cpus)"},
		{"metadata key", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: map[string]string{"a/b": "x"}, RequireAttestation: no}, apierr.InvalidRequest, "metadata key"},
		// Hostile keys (issue 8): each would be unreachable or ambiguous at /metadata/<key>.
		{"metadata key ..", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: map[string]string{"..": "x"}, RequireAttestation: no}, apierr.InvalidRequest, "metadata key"},
		{"metadata key .", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: map[string]string{".": "x"}, RequireAttestation: no}, apierr.InvalidRequest, "metadata key"},
		{"metadata key NUL", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: map[string]string{"a\x00b": "x"}, RequireAttestation: no}, apierr.InvalidRequest, "metadata key"},
		{"metadata key CR", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: map[string]string{"a\rb": "x"}, RequireAttestation: no}, apierr.InvalidRequest, "metadata key"},
		{"metadata key DEL", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: map[string]string{"a\x7f": "x"}, RequireAttestation: no}, apierr.InvalidRequest, "metadata key"},
		{"metadata key NBSP", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: map[string]string{"a\u00a0b": "x"}, RequireAttestation: no}, apierr.InvalidRequest, "metadata key"},
		{"metadata key long", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: map[string]string{strings.Repeat("k", MaxMetadataKeyBytes+1): "x"}, RequireAttestation: no}, apierr.InvalidRequest, "at most 128"},
		{"metadata entries", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: manyKeys(MaxMetadataEntries + 1), RequireAttestation: no}, apierr.InvalidRequest, "at most 128 metadata entries"},
		{"metadata bytes", &hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: map[string]string{"a": strings.Repeat("v", MaxMetadataBytes)}, RequireAttestation: no}, apierr.InvalidRequest, "metadata is"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := validate(c.req, images{}, testLimits)
			if apierr.CodeOf(err) != c.code || !strings.Contains(apierr.MessageOf(err), c.want) {
				t.Errorf("got %v (%s), want %s containing %q", err, apierr.CodeOf(err), c.code, c.want)
			}
		})
	}
}

var testLimits = Limits{MaxMemoryMiB: 4096, MaxCPUs: 4}

// sshKeys are n keys of size bytes each.
func sshKeys(n, size int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "ssh-ed25519 " + strings.Repeat("A", size-len("ssh-ed25519 "))
	}
	return keys
}

func TestValidateAtTheBounds(t *testing.T) {
	req := &hypervisorv1.CreateVirtualMachineRequest{Name: "a", SshAuthorizedKeys: sshKeys(MaxSSHKeys, MaxSSHKeyBytes),
		MemoryMib: proto.Int32(4096), Cpus: proto.Int32(4)}
	r, err := validate(req, images{}, testLimits)
	if err != nil {
		t.Fatalf("a request at every bound: %v", err)
	}
	if len(r.sshKeys) != MaxSSHKeys || r.memoryMiB != 4096 || r.cpus != 4 {
		t.Errorf("validated %d keys, %d MiB, %d cpus", len(r.sshKeys), r.memoryMiB, r.cpus)
	}
	// Without host bounds (0) only the fixed ones apply.
	if _, err := validate(&hypervisorv1.CreateVirtualMachineRequest{Name: "a", MemoryMib: proto.Int32(1 << 20), Cpus: proto.Int32(256)}, images{}, Limits{}); err != nil {
		t.Errorf("no host bounds: %v", err)
	}
}

func manyKeys(n int) map[string]string {
	m := make(map[string]string, n)
	for i := range n {
		m[fmt.Sprintf("k%d", i)] = "v"
	}
	return m
}

func TestValidateMetadataLimits(t *testing.T) {
	md := manyKeys(MaxMetadataEntries)
	md["role"] = ""
	delete(md, "k0")
	md[strings.Repeat("k", MaxMetadataKeyBytes)] = strings.Repeat("v", 1000)
	md["a.b_c-d:é"] = "x"
	delete(md, "k1")
	delete(md, "k2")
	if _, err := validate(&hypervisorv1.CreateVirtualMachineRequest{Name: "a", Metadata: md}, images{}, testLimits); err != nil {
		t.Fatalf("metadata at the limits: %v", err)
	}
}

func writeFile(p, s string) error { return os.WriteFile(p, []byte(s), 0o600) }
