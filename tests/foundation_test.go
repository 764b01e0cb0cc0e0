package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// policyJSON is a policy.json as the image pipeline writes it (contract §5.5).
const policyJSON = `{
  "image_id": "giantswarm-vm-base",
  "image_version": "0.2.0",
  "pcr11": {
    "enter-initrd": "1111111111111111111111111111111111111111111111111111111111111111",
    "enter-initrd:leave-initrd:sysinit:ready": "2222222222222222222222222222222222222222222222222222222222222222"
  },
  "golden": {"sha256": {
    "0": "0000000000000000000000000000000000000000000000000000000000000000",
    "7": "7777777777777777777777777777777777777777777777777777777777777777"
  }},
  "roothash": "abc"
}`

// writeCatalog lays out an image directory with two versions of a UKI image,
// a direct-kernel image and a Kubernetes sysupdate list.
func writeCatalog(t *testing.T, dir string) {
	t.Helper()
	files := map[string]string{
		"giantswarm-vm-base_0.1.0.efi":         "uki",
		"giantswarm-vm-base_0.1.0.raw":         "disk",
		"giantswarm-vm-base_0.2.0.efi":         "uki",
		"giantswarm-vm-base_0.2.0.raw":         "disk",
		"giantswarm-vm-base_0.2.0.policy.json": policyJSON,
		"test-guest_1.0.0.vmlinuz":             "kernel",
		"test-guest_1.0.0.initrd":              "initrd",
		"lonely_1.0.0.efi":                     "no disk",
		"sysupdate/kubernetes/SHA256SUMS":      "aa  kubernetes_v1.33.1.raw\nbb  kubernetes_v1.34.0.raw\n",
	}
	for name, content := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "vmm-bin-")
	if err != nil {
		panic(err)
	}
	if err := cluster.BuildBinaries(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// TestFoundation drives the three services over REST, gRPC through the
// gateway and grpcurl on the unix sockets: once in-process, once as the three
// real binaries.
func TestFoundation(t *testing.T) {
	for _, mode := range []cluster.Mode{cluster.InProcess, cluster.Processes} {
		t.Run(string(mode), func(t *testing.T) {
			images := t.TempDir()
			writeCatalog(t, images)
			c := cluster.Start(t, mode, binDir, cluster.Options{ImageDir: images})
			foundation(t, c, mode)
		})
	}
}

type envelope struct {
	Error struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

func expectError(t *testing.T, method, url, body string, wantStatus int, wantCode apierr.Code) string {
	t.Helper()
	code, hdr, b := cluster.Do(t, method, url, body)
	if code != wantStatus {
		t.Fatalf("%s %s: status %d, want %d: %s", method, url, code, wantStatus, b)
	}
	if ct := hdr.Get("Content-Type"); ct != "application/json" {
		t.Errorf("%s %s: content-type %q", method, url, ct)
	}
	var e envelope
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		t.Fatalf("%s %s: body is not the error envelope: %v: %s", method, url, err, b)
	}
	if e.Error.Code != string(wantCode) || e.Error.Message == "" {
		t.Fatalf("%s %s: error %+v, want code %s", method, url, e.Error, wantCode)
	}
	return e.Error.Message
}

func getJSON(t *testing.T, url string, into any) {
	t.Helper()
	code, hdr, b := cluster.Do(t, "GET", url, "")
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", url, code, b)
	}
	if ct := hdr.Get("Content-Type"); ct != "application/json" {
		t.Errorf("GET %s: content-type %q", url, ct)
	}
	if !bytes.HasPrefix(b, []byte("{\n  ")) && !bytes.HasPrefix(b, []byte("[\n  ")) && string(b) != "[]\n" {
		t.Errorf("GET %s: body is not 2-space indented JSON: %.40q", url, b)
	}
	if err := json.Unmarshal(b, into); err != nil {
		t.Fatalf("GET %s: %v: %s", url, err, b)
	}
}

// kvmOpens is the host report's device test, done independently.
func kvmOpens() bool {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return false
	}
	f.Close()
	return true
}

// hostAccelerator is what the running hypervisor chose.
func hostAccelerator(t *testing.T, api string) string {
	var host struct{ Accelerator string }
	getJSON(t, api+"/host", &host)
	return host.Accelerator
}

func foundation(t *testing.T, c *cluster.Cluster, mode cluster.Mode) {
	api := "http://" + c.Addr + "/api/v1"

	t.Run("host", func(t *testing.T) {
		var host struct {
			Kernel      string `json:"kernel"`
			CPUs        int    `json:"cpus"`
			MemoryBytes int64  `json:"memoryBytes"`
			KVM         struct {
				Path       string `json:"path"`
				Accessible bool   `json:"accessible"`
			} `json:"kvm"`
			QEMU struct {
				Found   bool
				Version string
			} `json:"qemu"`
			Swtpm       struct{ Found bool }    `json:"swtpm"`
			OVMFCode    string                  `json:"ovmfCode"`
			Firmware    struct{ SHA256 string } `json:"firmware"`
			Accelerator string                  `json:"accelerator"`
			Ready       bool                    `json:"ready"`
			Warnings    []string                `json:"warnings"`
			Missing     []string                `json:"missing"`
		}
		getJSON(t, api+"/host", &host)
		kernel, _ := os.ReadFile("/proc/sys/kernel/osrelease")
		if host.Kernel != strings.TrimSpace(string(kernel)) || host.CPUs < 1 || host.MemoryBytes < 1<<20 {
			t.Errorf("host report does not describe this machine: %+v", host)
		}
		kvmOpens := kvmOpens()
		switch {
		case host.KVM.Path != "/dev/kvm" || host.KVM.Accessible != kvmOpens:
			t.Errorf("kvm %+v, but opening /dev/kvm here gives %v", host.KVM, kvmOpens)
		case !kvmOpens && host.Accelerator != "tcg":
			t.Errorf("accelerator %q without /dev/kvm", host.Accelerator)
		case kvmOpens && host.Accelerator == "tcg" && !strings.Contains(strings.Join(host.Warnings, "\n"), "KVM cannot run a guest"):
			t.Errorf("/dev/kvm opens, accelerator tcg, and no warning says why: %q", host.Warnings)
		case host.Accelerator != "kvm" && host.Accelerator != "tcg":
			t.Errorf("accelerator %q", host.Accelerator)
		}
		cluster.RequireTool(t, "qemu-system-x86_64")
		cluster.RequireTool(t, "swtpm")
		if !host.QEMU.Found || !strings.Contains(host.QEMU.Version, "QEMU") || !host.Swtpm.Found || host.OVMFCode == "" || len(host.Firmware.SHA256) != 64 {
			t.Errorf("QEMU, swtpm and OVMF are installed but the report says %+v", host)
		}
		if !host.Ready || len(host.Missing) != 0 {
			t.Errorf("host not ready: missing %v", host.Missing)
		}
	})

	t.Run("errors", func(t *testing.T) {
		code, _, _ := cluster.Do(t, "GET", api+"/vms/nope", "")
		if code != http.StatusNotFound {
			t.Fatalf("GET /vms/nope: %d", code)
		}
		expectError(t, "GET", api+"/vms/nope", "", 404, apierr.NotFound)
		msg := expectError(t, "POST", api+"/vms", `{"name":"a","bogus":1}`, 400, apierr.InvalidRequest)
		if !strings.HasPrefix(msg, "body: ") || !strings.Contains(msg, "bogus") {
			t.Errorf("unknown field message %q", msg)
		}
		expectError(t, "POST", api+"/vms", `{"name":`, 400, apierr.InvalidRequest)
		expectError(t, "POST", api+"/vms", `{"name":"a","wait_for":"soon"}`, 400, apierr.InvalidRequest)
		expectError(t, "GET", api+"/nothing/here", "", 404, apierr.NotFound)
		// A known path with another method is no route, as in the original.
		if msg := expectError(t, "DELETE", api+"/host", "", 404, apierr.NotFound); msg != "no route DELETE /api/v1/host" {
			t.Errorf("DELETE /host: message %q", msg)
		}
		if msg := expectError(t, "POST", api+"/host", "", 404, apierr.NotFound); msg != "no route POST /api/v1/host" {
			t.Errorf("POST /host: message %q", msg)
		}
		if code, _, b := cluster.Do(t, "HEAD", api+"/host", ""); code != 200 || len(b) != 0 {
			t.Errorf("HEAD /host: %d %q, want the GET's 200 without a body", code, b)
		}
		expectError(t, "GET", api+"/images/nope_1", "", 404, apierr.NotFound)
		expectError(t, "GET", api+"/images/bad%20ref", "", 400, apierr.InvalidRequest)
		expectError(t, "GET", api+"/images/..%2Fetc", "", 404, apierr.NotFound) // never reaches the catalog
		big := `{"name":"a","user_data":"` + strings.Repeat("x", 9<<20) + `"}`
		expectError(t, "POST", api+"/vms", big, 400, apierr.InvalidRequest)
	})

	t.Run("lists", func(t *testing.T) {
		code, _, b := cluster.Do(t, "GET", api+"/vms", "")
		if code != 200 || strings.TrimSpace(string(b)) != "[]" {
			t.Errorf("GET /vms: %d %s, want an empty JSON array", code, b)
		}
		var nets []struct {
			Spec struct {
				Name, Cidr string
				EnableIMDS bool `json:"enableIMDS"`
			}
			Gateway string
			Leases  []any
		}
		getJSON(t, api+"/networks", &nets)
		if len(nets) != 1 || nets[0].Spec.Name != "default" || nets[0].Spec.Cidr != "192.168.127.0/24" || nets[0].Gateway != "192.168.127.1" || !nets[0].Spec.EnableIMDS || nets[0].Leases == nil {
			t.Errorf("networks %+v, want the default network", nets)
		}
	})

	t.Run("images", func(t *testing.T) {
		var imgs []struct {
			ID, Version, Ref, Kind string
			KubernetesVersions     []string
		}
		getJSON(t, api+"/images", &imgs)
		var refs []string
		for _, i := range imgs {
			refs = append(refs, i.Ref+":"+i.Kind)
		}
		want := []string{"giantswarm-vm-base_0.2.0:uki", "giantswarm-vm-base_0.1.0:uki", "test-guest_1.0.0:kernel"}
		if !reflect.DeepEqual(refs, want) {
			t.Errorf("images %v, want %v", refs, want)
		}
		if len(imgs) > 0 && !reflect.DeepEqual(imgs[0].KubernetesVersions, []string{"v1.34.0", "v1.33.1"}) {
			t.Errorf("kubernetes versions %v", imgs[0].KubernetesVersions)
		}
		var img struct {
			Ref    string
			Policy map[string]any
		}
		getJSON(t, api+"/images/giantswarm-vm-base", &img)
		if img.Ref != "giantswarm-vm-base_0.2.0" || img.Policy["roothash"] != "abc" {
			t.Errorf("bare id resolves to %+v", img)
		}
	})

	t.Run("policy imported into attestation", func(t *testing.T) {
		var pol struct {
			Image        string
			Document     map[string]any
			SourceSha256 string
			GoldenPcrs   []int
		}
		cluster.Eventually(t, 20*time.Second, "policy import", func() error {
			code, _, b := cluster.Do(t, "GET", api+"/images/giantswarm-vm-base_0.2.0/policy", "")
			if code != 200 {
				return fmt.Errorf("%d %s", code, b)
			}
			return json.Unmarshal(b, &pol)
		})
		var want map[string]any
		_ = json.Unmarshal([]byte(policyJSON), &want)
		if !reflect.DeepEqual(pol.Document, want) || !reflect.DeepEqual(pol.GoldenPcrs, []int{0, 7}) || len(pol.SourceSha256) != 64 {
			t.Errorf("stored policy %+v, want the catalog's document", pol)
		}
		var list []struct{ Image string }
		getJSON(t, api+"/policies", &list)
		if len(list) != 1 || list[0].Image != "giantswarm-vm-base_0.2.0" {
			t.Errorf("policies %+v", list)
		}
	})

	t.Run("openapi", func(t *testing.T) {
		var doc struct {
			OpenAPI string         `json:"openapi"`
			Paths   map[string]any `json:"paths"`
		}
		getJSON(t, api+"/openapi.json", &doc)
		if doc.OpenAPI != "3.1.0" || doc.Paths["/vms/{id}/start"] == nil {
			t.Errorf("openapi %s with %d paths", doc.OpenAPI, len(doc.Paths))
		}
		code, hdr, b := cluster.Do(t, "GET", api+"/openapi.yaml", "")
		if code != 200 || hdr.Get("Content-Type") != "application/yaml" || !bytes.Contains(b, []byte("openapi: 3.1.0")) {
			t.Errorf("openapi.yaml: %d %s", code, hdr.Get("Content-Type"))
		}
	})

	t.Run("grpc through the gateway", func(t *testing.T) {
		conn, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		hv := hypervisorv1.NewHypervisorServiceClient(conn)
		host, err := hv.GetHost(ctx, &hypervisorv1.GetHostRequest{})
		if err != nil || host.GetCpus() < 1 {
			t.Fatalf("GetHost: %v %v", host, err)
		}
		_, err = hv.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: "nope"})
		if apierr.CodeOf(err) != apierr.NotFound || status.Code(err) != codes.NotFound {
			t.Errorf("GetVirtualMachine(nope): %v, code %q", err, apierr.CodeOf(err))
		}
		imgs, err := hv.ListImages(ctx, &hypervisorv1.ListImagesRequest{})
		if err != nil || len(imgs.GetImages()) != 3 || imgs.GetImages()[2].GetKind() != hypervisorv1.ImageKind_IMAGE_KIND_KERNEL {
			t.Errorf("ListImages: %v %v", imgs, err)
		}
		at := attestationv1.NewAttestationServiceClient(conn)
		st, err := at.GetAttestationStatus(ctx, &attestationv1.GetAttestationStatusRequest{})
		if err != nil || st.GetMode() != attestationv1.Mode_MODE_VERIFY {
			t.Errorf("GetAttestationStatus: %v %v", st, err)
		}
		_, err = attestationv1.NewVerifierServiceClient(conn).ForgetVirtualMachine(ctx, &attestationv1.ForgetVirtualMachineRequest{VmId: "0123abcd"})
		if status.Code(err) != codes.Unimplemented {
			t.Errorf("the gateway exposes the internal verifier: %v", err)
		}
	})

	t.Run("grpcurl", func(t *testing.T) {
		grpcurl := requireGrpcurl(t)
		list := func(args ...string) string {
			out, err := exec.Command(grpcurl, append([]string{"-plaintext"}, args...)...).CombinedOutput()
			if err != nil {
				t.Fatalf("grpcurl %v: %v\n%s", args, err, out)
			}
			return string(out)
		}
		common := []string{"grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"}
		checks := []struct {
			args    []string
			want    []string
			notWant []string
		}{
			{[]string{"-unix", c.Socket("hypervisor"), "list"}, append(common, "vmmanager.hypervisor.v1.HypervisorService"), nil},
			{[]string{"-unix", c.Socket("attestation"), "list"}, append(common, "vmmanager.attestation.v1.AttestationService"), []string{"VerifierService"}},
			{[]string{"-unix", c.VerifierSocket(), "list"}, append(common, "vmmanager.attestation.v1.VerifierService"), []string{"AttestationService"}},
			{[]string{c.Addr, "list"}, append(common, "vmmanager.hypervisor.v1.HypervisorService", "vmmanager.attestation.v1.AttestationService"), []string{"VerifierService"}},
		}
		for _, ck := range checks {
			out := list(ck.args...)
			for _, w := range ck.want {
				if !strings.Contains(out, w+"\n") {
					t.Errorf("grpcurl %v lacks %s:\n%s", ck.args, w, out)
				}
			}
			for _, w := range ck.notWant {
				if strings.Contains(out, w) {
					t.Errorf("grpcurl %v lists %s:\n%s", ck.args, w, out)
				}
			}
		}
		out, err := exec.Command(grpcurl, "-plaintext", "-d", `{"id":"nope"}`, c.Addr, "vmmanager.hypervisor.v1.HypervisorService/GetVirtualMachine").CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 64+int(codes.NotFound) || !strings.Contains(string(out), `"reason": "not_found"`) {
			t.Errorf("grpcurl GetVirtualMachine(nope): %v\n%s", err, out)
		}
	})

	t.Run("sockets are private", func(t *testing.T) {
		fi, err := os.Stat(c.RunDir)
		if err != nil || fi.Mode().Perm() != 0o700 {
			t.Errorf("run dir %v %v", fi.Mode(), err)
		}
		for _, s := range []string{"hypervisor", "attestation"} {
			fi, err := os.Stat(c.Socket(s))
			if err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
				t.Errorf("%s socket %v %v", s, fi.Mode(), err)
			}
		}
	})

	t.Run("backend restarts", func(t *testing.T) {
		for _, backend := range []struct{ name, path string }{{"hypervisor", "/host"}, {"attestation", "/policies"}} {
			c.StopService(backend.name)
			code, _, b := cluster.Do(t, "GET", "http://"+c.Addr+"/readyz", "")
			if code != http.StatusServiceUnavailable || !strings.Contains(string(b), backend.name) {
				t.Errorf("/readyz with %s down: %d %s", backend.name, code, b)
			}
			msg := expectError(t, "GET", api+backend.path, "", 503, apierr.Unavailable)
			if !strings.Contains(msg, backend.name) {
				t.Errorf("unavailable message does not name the %s: %q", backend.name, msg)
			}
			c.StartService(backend.name)
			c.WaitReady(20 * time.Second)
			cluster.Eventually(t, 10*time.Second, backend.name+" through the gateway", func() error {
				if code, _, b := cluster.Do(t, "GET", api+backend.path, ""); code != 200 {
					return fmt.Errorf("%d %s", code, b)
				}
				return nil
			})
		}
		// The policy survived the attestation restart: it is in bbolt.
		code, _, b := cluster.Do(t, "GET", api+"/images/giantswarm-vm-base_0.2.0/policy", "")
		if code != 200 {
			t.Errorf("policy lost across an attestation restart: %d %s", code, b)
		}
	})

	if mode == cluster.Processes {
		t.Run("second process on the same state dir", func(t *testing.T) {
			for _, s := range []string{"hypervisor", "attestation"} {
				cmd := exec.Command(filepath.Join(binDir, "vmm-"+s), "serve", "--socket", filepath.Join(c.Dir, "other-"+s+".sock"))
				cmd.Env = append(os.Environ(), "VM_MANAGER_STATE_DIR="+c.StateDir, "VM_MANAGER_RUN_DIR="+c.RunDir)
				out, err := cmd.CombinedOutput()
				if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(string(out), "locked by pid") {
					t.Errorf("second %s: %v\n%s", s, err, out)
				}
			}
		})
	}
}

// requireGrpcurl finds grpcurl in ../bin (make tools) or on PATH.
func requireGrpcurl(t *testing.T) string {
	t.Helper()
	if p, err := filepath.Abs("../bin/grpcurl"); err == nil {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return cluster.RequireTool(t, "grpcurl")
}
