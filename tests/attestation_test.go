package tests

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

var zeros = strings.Repeat("0", 64)

// attPolicy is a policy whose golden values are a fresh swtpm's PCRs (zeros).
func attPolicy(pcr0 string) string {
	return fmt.Sprintf(`{"image_id":"att-image","image_version":"1.0.0",
 "pcr11":{"enter-initrd":"%[1]s","enter-initrd:leave-initrd:sysinit:ready":"%[1]s"},
 "pcr13":{"v1.34.0":"%[1]s"},
 "golden":{"sha256":{"0":"%[2]s","2":"%[1]s","3":"%[1]s","4":"%[1]s","6":"%[1]s","7":"%[1]s"}}}`, zeros, pcr0)
}

// swtpmServer starts a TPM the way a guest would see one: vm-agent talks to
// its server socket.
func swtpmServer(t *testing.T) string { return swtpmServerTB(t) }

func swtpmServerTB(t testing.TB) string {
	t.Helper()
	cluster.RequireTool(t, "swtpm")
	dir, err := os.MkdirTemp("", "vmm-tpm-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "tpm.sock")
	cmd := exec.Command("swtpm", "socket", "--tpm2", "--tpmstate", "dir="+dir,
		"--server", "type=unixio,path="+sock, "--ctrl", "type=unixio,path="+filepath.Join(dir, "ctrl.sock"),
		"--flags", "not-need-init,startup-clear")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	cluster.Eventually(t, 5*time.Second, "swtpm socket", func() error {
		c, err := net.Dial("unix", sock)
		if err == nil {
			c.Close()
		}
		return err
	})
	return sock
}

// guestQuote has the real guest agent quote the TPM for a nonce.
func guestQuote(t testing.TB, tpm string, stage attestationv1.Stage, nonce []byte) *attestationv1.VerifyQuoteRequest {
	t.Helper()
	name := map[attestationv1.Stage]string{attestationv1.Stage_STAGE_INITRD: "initrd", attestationv1.Stage_STAGE_READY: "ready"}[stage]
	out, err := exec.Command(filepath.Join(binDir, "vm-agent"), "attest", "--stage="+name, "--print", "--nonce", hex.EncodeToString(nonce), "--tpm", tpm).Output()
	if err != nil {
		t.Fatalf("vm-agent attest --print: %v", err)
	}
	var body struct {
		Nonce, AKPub, Quote, Signature string
		PCRs                           map[string]map[string]string
	}
	if err := json.Unmarshal(out, &struct {
		Nonce     *string                       `json:"nonce"`
		AKPub     *string                       `json:"ak_pub"`
		Quote     *string                       `json:"quote"`
		Signature *string                       `json:"signature"`
		PCRs      *map[string]map[string]string `json:"pcrs"`
	}{&body.Nonce, &body.AKPub, &body.Quote, &body.Signature, &body.PCRs}); err != nil {
		t.Fatalf("vm-agent output: %v\n%s", err, out)
	}
	b64 := func(s string) []byte {
		b, err := base64.StdEncoding.DecodeString(s)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	req := &attestationv1.VerifyQuoteRequest{Stage: stage, Nonce: nonce, AkPub: b64(body.AKPub), Quote: b64(body.Quote), Signature: b64(body.Signature), Pcrs: map[uint32][]byte{}}
	for idx, v := range body.PCRs["sha256"] {
		i, _ := strconv.Atoi(idx)
		req.Pcrs[uint32(i)], _ = hex.DecodeString(v)
	}
	return req
}

// TestAttestation drives the attestation service as the hypervisor does, over
// its unix socket, with quotes from the real guest agent and a real swtpm:
// nonces lost in a SIGKILL of the service (a retry, not a verdict), verdicts
// and pins surviving it, rejections, and recording golden values.
func TestAttestation(t *testing.T) {
	images := t.TempDir()
	for name, content := range map[string]string{
		"att-image_1.0.0.vmlinuz": "k", "att-image_1.0.0.initrd": "i", "att-image_1.0.0.policy.json": attPolicy(zeros),
	} {
		if err := os.WriteFile(filepath.Join(images, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images})
	api := "http://" + c.Addr + "/api/v1"
	cluster.Eventually(t, 20*time.Second, "policy import", func() error {
		if code, _, b := cluster.Do(t, "GET", api+"/images/att-image_1.0.0/policy", ""); code != 200 {
			return fmt.Errorf("%d %s", code, b)
		}
		return nil
	})
	verifier := func() attestationv1.VerifierServiceClient {
		conn, err := grpc.NewClient("unix://"+c.VerifierSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return attestationv1.NewVerifierServiceClient(conn)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	v := verifier()
	const vm, other = "0a0b0c0d", "0e0e0e0e"
	firmware := &attestationv1.FirmwareBuild{Sha256: strings.Repeat("ab", 32), Package: "ovmf", Version: "2022.11-6"}
	// The AK vm-agent makes on this swtpm stands in for the one the
	// hypervisor provisions; the hypervisor registers it with the boot.
	tpm := swtpmServer(t)
	ak := guestQuote(t, tpm, attestationv1.Stage_STAGE_INITRD, make([]byte, 32)).GetAkPub()
	for _, id := range []string{vm, other} {
		if _, err := v.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: id, Image: "att-image_1.0.0", KubernetesVersion: "v1.34.0", Required: true, Firmware: firmware, AkPublic: ak}); err != nil {
			t.Fatal(err)
		}
	}
	nonce := func(id string) []byte {
		t.Helper()
		n, err := v.IssueNonce(ctx, &attestationv1.IssueNonceRequest{VmId: id})
		if err != nil || len(n.GetNonce()) != 32 {
			t.Fatalf("IssueNonce: %v %v", n, err)
		}
		return n.GetNonce()
	}
	expect := func(req *attestationv1.VerifyQuoteRequest, verified bool, msg string) *attestationv1.VerifyQuoteResponse {
		t.Helper()
		resp, err := v.VerifyQuote(ctx, req)
		if err != nil {
			t.Fatalf("VerifyQuote: %v", err)
		}
		if resp.GetVerified() != verified || !strings.Contains(resp.GetMessage(), msg) {
			t.Fatalf("verdict %v %q, want %v %q", resp.GetVerified(), resp.GetMessage(), verified, msg)
		}
		return resp
	}

	// Nonces live in attestation's memory: a SIGKILL loses them. A quote on
	// one is answered unavailable, which the IMDS passes on as a 500 and
	// vm-agent retries with a new nonce (a 403 verdict would be final), and
	// records nothing. Another VM's nonce from before the kill is still
	// refused as unknown, and a fresh nonce verifies.
	n, otherN := nonce(vm), nonce(other)
	c.StopService("attestation")
	c.StartService("attestation")
	initrd := guestQuote(t, tpm, attestationv1.Stage_STAGE_INITRD, n)
	initrd.VmId = vm
	if _, err := v.VerifyQuote(ctx, initrd); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "issued before attestation restarted") {
		t.Fatalf("quote on a nonce issued before the kill: %v, want unavailable", err)
	}
	q := guestQuote(t, tpm, attestationv1.Stage_STAGE_INITRD, otherN)
	q.VmId = vm
	expect(q, false, "unknown or expired nonce")
	var status0 struct {
		Nonces struct{ Issued, Outstanding, LostInRestart json.Number }
	}
	getJSON(t, api+"/attestation", &status0)
	if status0.Nonces.LostInRestart != "1" || status0.Nonces.Issued != "0" || status0.Nonces.Outstanding != "0" {
		t.Errorf("nonce counters after the restart: %+v", status0.Nonces) // the restarted service issued none
	}
	initrd = guestQuote(t, tpm, attestationv1.Stage_STAGE_INITRD, nonce(vm))
	initrd.VmId = vm
	resp := expect(initrd, true, "verified: ak ")
	if !resp.GetUserDataReleased() || resp.GetAttestation().GetInitrd().GetAkFingerprint() == "" {
		t.Errorf("verified initrd quote: %+v", resp)
	}
	pinned := resp.GetAttestation().GetInitrd().GetAkFingerprint()
	// The same nonce again: single use.
	expect(initrd, false, "unknown or expired nonce")
	// Another VM's nonce.
	q = guestQuote(t, tpm, attestationv1.Stage_STAGE_INITRD, nonce(other))
	q.VmId = vm
	expect(q, false, "unknown or expired nonce")

	ready := guestQuote(t, tpm, attestationv1.Stage_STAGE_READY, nonce(vm))
	ready.VmId = vm
	expect(ready, true, "pcr 13 kubernetes v1.34.0")

	// Keys and verdicts survive a SIGKILL.
	c.StopService("attestation")
	c.StartService("attestation")
	var att struct {
		Required, UserDataReleased bool
		Initrd, Ready              struct {
			Verified      bool
			AkFingerprint string
		}
	}
	getJSON(t, api+"/vms/"+vm+"/attestation", &att)
	if !att.Required || !att.UserDataReleased || !att.Initrd.Verified || !att.Ready.Verified || att.Initrd.AkFingerprint != pinned {
		t.Errorf("attestation after restart: %+v", att)
	}
	// Another TPM (another AK) for the pinned VM.
	q = guestQuote(t, swtpmServer(t), attestationv1.Stage_STAGE_INITRD, nonce(vm))
	q.VmId = vm
	expect(q, false, "is not the vTPM key of vm "+vm+" (the host registered "+pinned[:16]+")")

	// A golden mismatch on PCR 0.
	if code, _, b := cluster.Do(t, "PUT", api+"/images/att-image_1.0.0/policy", attPolicy(strings.Repeat("f", 64))); code != 200 {
		t.Fatalf("import policy: %d %s", code, b)
	}
	q = guestQuote(t, tpm, attestationv1.Stage_STAGE_INITRD, nonce(vm))
	q.VmId = vm
	expect(q, false, "golden mismatch: pcr 0 expected "+strings.Repeat("f", 64)+", got "+zeros)

	// RecordGolden takes the VM's verified ready PCRs.
	code, _, b := cluster.Do(t, "POST", api+"/images/att-image_1.0.0/policy/golden", `{"from_vm":"`+vm+`"}`)
	var recorded struct {
		GoldenFromVm string
		GoldenPcrs   []int
		Document     struct {
			GoldenFirmware map[string]string `json:"golden_firmware"`
		}
	}
	if code != 200 || json.Unmarshal(b, &recorded) != nil || recorded.GoldenFromVm != vm || len(recorded.GoldenPcrs) != 7 || // 2,3,4,6,7, 9 (quoted by the agent) and 13: not 0, which depends on the vm's shape
		recorded.Document.GoldenFirmware["sha256"] != firmware.GetSha256() || recorded.Document.GoldenFirmware["version"] != firmware.GetVersion() {
		t.Fatalf("record golden: %d %s", code, b)
	}
	q = guestQuote(t, tpm, attestationv1.Stage_STAGE_INITRD, nonce(vm))
	q.VmId = vm
	expect(q, true, "verified")

	// A firmware update: the golden values were recorded on another build,
	// and the rejection says which (PCR 0 itself depends on the VM's
	// memory and vCPUs, so the build is checked by identity).
	if _, err := v.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vm, Image: "att-image_1.0.0", KubernetesVersion: "v1.34.0", Required: true,
		Firmware: &attestationv1.FirmwareBuild{Sha256: strings.Repeat("cd", 32), Package: "ovmf", Version: "2025.02-1"}}); err != nil {
		t.Fatal(err)
	}
	q = guestQuote(t, tpm, attestationv1.Stage_STAGE_INITRD, nonce(vm))
	q.VmId = vm
	expect(q, false, "firmware mismatch: the golden values were recorded on firmware ovmf 2022.11-6 (sha256 abababababababab), this vm boots ovmf 2025.02-1 (sha256 cdcdcdcdcdcdcdcd)")

	// A policy without golden values rejects outside learn mode.
	if code, _, b := cluster.Do(t, "DELETE", api+"/images/att-image_1.0.0/policy/golden", ""); code != 200 {
		t.Fatalf("clear golden: %d %s", code, b)
	}
	q = guestQuote(t, tpm, attestationv1.Stage_STAGE_INITRD, nonce(vm))
	q.VmId = vm
	expect(q, false, "no golden value for pcr 2, 3, 4, 6, 7 in the image policy")
	expectError(t, "POST", api+"/images/att-image_1.0.0/policy/golden", `{"from_vm":"`+other+`"}`, 409, apierr.Conflict)
}
