package tests

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// attackVM is the part of a VM record the attacks read.
type attackVM struct {
	ID        string `json:"id"`
	State     string `json:"state"`
	LastError string `json:"lastError"`
	BootCount int    `json:"bootCount"`
	Tpm       *struct {
		AkFingerprint string `json:"akFingerprint"`
		AkPublic      string `json:"akPublic"`
		EkCertificate string `json:"ekCertificate"`
	} `json:"tpm"`
	Attestation struct {
		Boot             any    `json:"boot"` // a uint64: a string in JSON
		UserDataReleased bool   `json:"userDataReleased"`
		AkFingerprint    string `json:"akFingerprint"`
		AkOrigin         string `json:"akOrigin"`
	} `json:"attestation"`
}

func (a api) record(id string) attackVM {
	a.t.Helper()
	code, _, b := cluster.Do(a.t, "GET", a.base+"/vms/"+id, "")
	var v attackVM
	if code != 200 || json.Unmarshal(b, &v) != nil {
		a.t.Fatalf("get %s: %d %s", id, code, b)
	}
	return v
}

// guestAttacker is attest-attack copied into a running guest.
type guestAttacker struct {
	a          api
	bin        []byte
	sum        string
	fwd        map[string]string // vm -> the forward to its upload port
	uploadPort int
}

func newGuestAttacker(t *testing.T, a api) *guestAttacker {
	t.Helper()
	out := filepath.Join(t.TempDir(), "attest-attack")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, "github.com/giantswarm/vm-manager/guest/cmd/attest-attack")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build attest-attack: %v\n%s", err, b)
	}
	bin, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(bin)
	return &guestAttacker{a: a, bin: bin, sum: hex.EncodeToString(sum[:]), fwd: map[string]string{}, uploadPort: 7777}
}

// upload copies the binary to /tmp/attest-attack in the guest: busybox nc
// listens there, the test writes to it through a port forward.
func (g *guestAttacker) upload(id string) {
	a := g.a
	a.t.Helper()
	if g.fwd[id] == "" {
		g.fwd[id] = a.forward(id, g.uploadPort)
	}
	start := time.Now()
	cluster.Eventually(a.t, 2*time.Minute, "upload of attest-attack to "+id, func() error {
		a.sh(id, fmt.Sprintf("mkdir -p /tmp; rm -f /tmp/attest-attack; busybox nc -l -p %d >/tmp/attest-attack </dev/null 2>/dev/null &", g.uploadPort))
		time.Sleep(300 * time.Millisecond)
		c, err := net.DialTimeout("tcp", g.fwd[id], 5*time.Second)
		if err != nil {
			return err
		}
		_ = c.SetDeadline(time.Now().Add(time.Minute))
		_, err = c.Write(g.bin)
		if err == nil {
			err = c.(*net.TCPConn).CloseWrite()
		}
		buf := make([]byte, 1)
		_, _ = c.Read(buf) // nc closes once it has it all
		c.Close()
		if err != nil {
			return err
		}
		var r execJSON
		for range 20 {
			if r = a.sh(id, "sha256sum /tmp/attest-attack && chmod 755 /tmp/attest-attack"); strings.HasPrefix(r.Stdout, g.sum) {
				return nil
			}
			time.Sleep(250 * time.Millisecond)
		}
		return fmt.Errorf("checksum in the guest: %q %q", r.Stdout, r.Stderr)
	})
	a.t.Logf("attest-attack (%d bytes) copied into %s in %s", len(g.bin), id, time.Since(start).Round(time.Millisecond))
}

func (g *guestAttacker) run(id string, args ...string) string {
	g.a.t.Helper()
	r := g.a.exec(id, append([]string{"/tmp/attest-attack"}, args...)...)
	if r.ExitCode != 0 {
		g.a.t.Fatalf("attest-attack %v in %s: exit %d: %s%s", args, id, r.ExitCode, r.Stdout, r.Stderr)
	}
	return r.Stdout
}

// line is the output line that starts with prefix, without it.
func line(t *testing.T, out, prefix string) string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if rest, ok := strings.CutPrefix(l, prefix); ok {
			return rest
		}
	}
	t.Fatalf("no %q line in:\n%s", prefix, out)
	return ""
}

// userDataStatus fetches /user-data from inside the guest, as Ignition would.
func (a api) userDataStatus(id string) string {
	a.t.Helper()
	r := a.sh(id, "busybox wget -S -O /dev/null http://169.254.169.254/giantswarm/v1/user-data 2>&1 | busybox grep -m1 'HTTP/'")
	return strings.TrimSpace(r.Stdout)
}

// TestAttacks is the attestation attack suite (docs/reliability.md): real
// guests, a hostile program inside them, and the three binaries. Each attack
// prints the refusal it met. Golden values come from a first VM booted in
// learn mode, as in the bring-up recipe; then learn mode is off.
func TestAttacks(t *testing.T) {
	images := t.TempDir()
	src := cluster.GuestImages(t, "..")
	// The same kernel, initrd and command line as the test guest under
	// another image name: its PCRs are the golden ones, but it has no policy
	// until the attacks import one.
	for _, ext := range []string{".vmlinuz", ".initrd", ".cmdline"} {
		for _, name := range []string{"test-guest_0.1.0", "target-guest_0.1.0"} {
			if err := os.Symlink(filepath.Join(src, "test-guest_0.1.0"+ext), filepath.Join(images, name+ext)); err != nil {
				t.Fatal(err)
			}
		}
	}
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, LearnGolden: true})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })
	g := newGuestAttacker(t, a)

	// Golden values from a first VM (learn mode), then learn mode off.
	golden := a.vm("POST", "/vms", `{"name":"golden","image":"test-guest","memory_mib":384,"cpus":1}`, 201)
	code, _, b := cluster.Do(t, "POST", a.base+"/images/test-guest_0.1.0/policy/golden", `{"from_vm":"`+golden.ID+`"}`)
	if code != 200 {
		t.Fatalf("record golden: %d %s", code, b)
	}
	var pol struct {
		Document map[string]any `json:"document"`
	}
	if err := json.Unmarshal(b, &pol); err != nil {
		t.Fatal(err)
	}
	c.StopService("attestation")
	c.SetLearnGolden(false)
	c.StartService("attestation")
	c.WaitReady(20 * time.Second)
	importPolicy := func(mutate func(golden map[string]any)) {
		t.Helper()
		doc := map[string]any{"image_id": "target-guest", "image_version": "0.1.0"}
		gold := map[string]any{}
		for k, v := range pol.Document["golden"].(map[string]any)["sha256"].(map[string]any) {
			gold[k] = v
		}
		if mutate != nil {
			mutate(gold)
		}
		doc["golden"] = map[string]any{"sha256": gold}
		raw, _ := json.Marshal(doc)
		if code, _, b := cluster.Do(t, "PUT", a.base+"/images/target-guest_0.1.0/policy", string(raw)); code != 200 {
			t.Fatalf("import policy: %d %s", code, b)
		}
	}

	// The target: attestation required, a secret in its user-data, its
	// first boot rejected for want of a policy (the agent's real quote
	// pinned nothing, and user-data stayed gated).
	target := a.vm("POST", "/vms", `{"name":"target","image":"target-guest","memory_mib":384,"cpus":1,"require_attestation":true,"user_data":`+ignitionFile("/etc/secret", "s3cret")+`}`, 201)
	rec := a.record(target.ID)
	if rec.Tpm == nil || rec.Tpm.AkFingerprint == "" || !strings.Contains(rec.Tpm.AkPublic, "BEGIN PUBLIC KEY") || !strings.Contains(rec.Tpm.EkCertificate, "BEGIN CERTIFICATE") ||
		rec.Attestation.AkFingerprint != rec.Tpm.AkFingerprint || rec.Attestation.AkOrigin != "host" || rec.Attestation.UserDataReleased || rec.BootCount != 1 {
		t.Fatalf("target: %+v", rec)
	}
	if !strings.Contains(rec.LastError, "no policy for image target-guest_0.1.0") {
		t.Fatalf("target's first boot: %q", rec.LastError)
	}
	importPolicy(nil)
	g.upload(target.ID)

	t.Run("a software key claiming the golden PCRs", func(t *testing.T) {
		a.t = t
		out := g.run(target.ID, "forge", "--stage", "initrd")
		quote, ud := line(t, out, "quote: "), line(t, out, "user-data: ")
		t.Logf("the IMDS answered: %s", quote)
		want := "is not the vTPM key of vm " + target.ID + " (the host registered " + rec.Tpm.AkFingerprint[:16] + ")"
		if !strings.HasPrefix(quote, "403 ") || !strings.Contains(quote, want) || !strings.Contains(quote, `"user_data_released":false`) {
			t.Errorf("forged quote: %s, want 403 with %q", quote, want)
		}
		if !strings.HasPrefix(ud, "503 ") {
			t.Errorf("user-data after the forged quote: %s", ud)
		}
		if r := a.record(target.ID); r.Attestation.UserDataReleased || r.Attestation.AkFingerprint != rec.Tpm.AkFingerprint {
			t.Errorf("record after the forged quote: %+v", r.Attestation)
		}
		// The VM's own vTPM, with the key the host registered, verifies.
		if r := a.exec(target.ID, "/init", "attest", "--stage=initrd"); r.ExitCode != 0 {
			t.Fatalf("the real vTPM's quote: exit %d %s%s", r.ExitCode, r.Stdout, r.Stderr)
		}
		if s := a.userDataStatus(target.ID); !strings.Contains(s, "200") {
			t.Errorf("user-data after the real quote: %q", s)
		}
	})

	t.Run("a reset closes the gate, and a quote of the previous boot is refused", func(t *testing.T) {
		a.t = t
		before := a.record(target.ID)
		if !before.Attestation.UserDataReleased {
			t.Fatalf("not released before the reset: %+v", before.Attestation)
		}
		// A genuine quote of this boot, kept for the next one.
		nonce := strings.TrimSpace(g.run(target.ID, "nonce"))
		kept := a.exec(target.ID, "/init", "attest", "--stage=initrd", "--print", "--nonce", nonce)
		if kept.ExitCode != 0 || !strings.Contains(kept.Stdout, `"quote"`) {
			t.Fatalf("vm-agent attest --print: %+v", kept)
		}
		// What boots next is not what the policy vouches for (a changed
		// boot chain: here the policy changed instead), and the guest resets.
		importPolicy(func(g map[string]any) { g["4"] = strings.Repeat("e", 64) })
		a.sh(target.ID, "touch /tmp/previous-boot; (sleep 1; busybox reboot -f) >/dev/null 2>&1 </dev/null &")
		// The next boot is up once its agent has quoted (and been refused).
		var after attackVM
		cluster.Eventually(t, bootTimeout, "the next boot of "+target.ID, func() error {
			after = a.record(target.ID)
			if after.State != "ready" || !strings.Contains(after.LastError, "pcr 4 expected") {
				return fmt.Errorf("boot %d state %s, lastError %q", after.BootCount, after.State, after.LastError)
			}
			return nil
		})
		if r := a.sh(target.ID, "test -e /tmp/previous-boot && echo same boot"); strings.Contains(r.Stdout, "same boot") {
			t.Fatal("the guest did not reboot")
		}
		t.Logf("after the reset: boot %d, attestation boot %v, lastError %q", after.BootCount, after.Attestation.Boot, after.LastError)
		if after.BootCount != before.BootCount+1 || fmt.Sprint(after.Attestation.Boot) == fmt.Sprint(before.Attestation.Boot) || after.Attestation.UserDataReleased {
			t.Errorf("the new boot inherited the old one's gate: %+v", after)
		}
		if s := a.userDataStatus(target.ID); !strings.Contains(s, "503") {
			t.Errorf("user-data in the new boot before a verified quote: %q", s)
		}
		// The previous boot's quote, replayed with the right policy back.
		importPolicy(nil)
		g.upload(target.ID)
		write := a.sh(target.ID, "cat > /tmp/kept.json <<'EOF'\n"+kept.Stdout+"\nEOF")
		if write.ExitCode != 0 {
			t.Fatal(write)
		}
		quote := line(t, g.run(target.ID, "submit", "/tmp/kept.json"), "quote: ")
		t.Logf("the IMDS answered: %s", quote)
		if !strings.HasPrefix(quote, "403 ") || !strings.Contains(quote, "unknown or expired nonce") {
			t.Errorf("replayed quote of boot %v: %s", before.Attestation.Boot, quote)
		}
		if s := a.userDataStatus(target.ID); !strings.Contains(s, "503") {
			t.Errorf("user-data after the replay: %q", s)
		}
		// A fresh quote of this boot opens it.
		if r := a.exec(target.ID, "/init", "attest", "--stage=initrd"); r.ExitCode != 0 {
			t.Fatalf("fresh quote: %+v", r)
		}
		if s := a.userDataStatus(target.ID); !strings.Contains(s, "200") {
			t.Errorf("user-data after a fresh verified quote: %q", s)
		}
	})

	t.Run("a nonce lost when attestation restarts costs a retry, not a verdict", func(t *testing.T) {
		a.t = t
		// Nonces live in attestation's memory. A genuine quote on a nonce
		// fetched before attestation's SIGKILL, submitted after its restart.
		n := strings.TrimSpace(g.run(target.ID, "nonce"))
		q := a.exec(target.ID, "/init", "attest", "--stage=initrd", "--print", "--nonce", n)
		if q.ExitCode != 0 || !strings.Contains(q.Stdout, `"quote"`) {
			t.Fatalf("vm-agent attest --print: %+v", q)
		}
		a.sh(target.ID, "cat > /tmp/lost.json <<'EOF'\n"+q.Stdout+"\nEOF")
		verdict := func() string {
			var att struct{ Initrd json.RawMessage }
			getJSON(t, a.base+"/vms/"+target.ID+"/attestation", &att)
			return string(att.Initrd)
		}
		before := verdict()
		c.StopService("attestation")
		c.StartService("attestation")
		c.WaitReady(20 * time.Second)
		quote := line(t, g.run(target.ID, "submit", "/tmp/lost.json"), "quote: ")
		t.Logf("the IMDS answered: %s", quote)
		// Not a 403: vm-agent takes that as final. A 500 it retries.
		if !strings.HasPrefix(quote, "500 ") || !strings.Contains(quote, "attestation unavailable") {
			t.Errorf("quote on a nonce lost in the restart: %s, want 500", quote)
		}
		if after := verdict(); after != before {
			t.Errorf("the lost nonce's quote changed the verdict: %s, was %s", after, before)
		}
		if r := a.record(target.ID); !r.Attestation.UserDataReleased || strings.Contains(r.LastError, "nonce") {
			t.Errorf("record after the lost nonce's quote: %+v", r)
		}
		// vm-agent fetches a new nonce and verifies.
		if r := a.exec(target.ID, "/init", "attest", "--stage=initrd"); r.ExitCode != 0 {
			t.Fatalf("vm-agent attest after the restart: %+v", r)
		}
	})

	t.Run("another VM's nonce and quote", func(t *testing.T) {
		a.t = t
		g.upload(golden.ID)
		// The golden VM quotes its own (golden) PCRs with its own vTPM, on a
		// nonce the target fetched.
		theirs := strings.TrimSpace(g.run(target.ID, "nonce"))
		mine := a.exec(golden.ID, "/init", "attest", "--stage=initrd", "--print", "--nonce", theirs)
		a.sh(golden.ID, "cat > /tmp/q.json <<'EOF'\n"+mine.Stdout+"\nEOF")
		quote := line(t, g.run(golden.ID, "submit", "/tmp/q.json"), "quote: ")
		t.Logf("the IMDS answered: %s", quote)
		if !strings.HasPrefix(quote, "403 ") || !strings.Contains(quote, "unknown or expired nonce") {
			t.Errorf("quote on another vm's nonce: %s", quote)
		}
		// The target's whole quote, submitted by the golden VM.
		n := strings.TrimSpace(g.run(target.ID, "nonce"))
		whole := a.exec(target.ID, "/init", "attest", "--stage=initrd", "--print", "--nonce", n)
		a.sh(golden.ID, "cat > /tmp/q.json <<'EOF'\n"+whole.Stdout+"\nEOF")
		quote = line(t, g.run(golden.ID, "submit", "/tmp/q.json"), "quote: ")
		t.Logf("the IMDS answered: %s", quote)
		if !strings.HasPrefix(quote, "403 ") {
			t.Errorf("another vm's whole quote: %s", quote)
		}
	})

	t.Run("the gateway's reach", func(t *testing.T) {
		a.t = t
		// Everything the gateway can dial lives in the runtime directory;
		// none of it opens a gate without a caller.
		n := probeVerifier(t, c.RunDir, target.ID)
		if n == 0 {
			t.Fatalf("no socket found in %s", c.RunDir)
		}
		if r := a.record(target.ID); !r.Attestation.UserDataReleased {
			t.Errorf("record after the probe: %+v", r.Attestation)
		}
		// The probe finds the verifier where it is (the state directory,
		// which only the hypervisor and attestation have).
		if !cluster.ReachesVerifier(c.VerifierSocket()) {
			t.Error("the probe cannot reach the verifier even on its own socket: it proves nothing")
		}
	})
}

// probeVerifier calls VerifierService.BeginBoot, with required false, on
// every unix socket below dir, and fails for any that answers: from there the
// call would open vm's user-data gate without anyone's identity. It returns
// how many sockets it tried.
func probeVerifier(t *testing.T, dir, vm string) int {
	t.Helper()
	sockets := cluster.Sockets(dir)
	for _, p := range sockets {
		conn, err := mesh.Dial(p)
		if err != nil {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err = attestationv1.NewVerifierServiceClient(conn).BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vm, Image: "target-guest_0.1.0", Required: false})
		cancel()
		conn.Close()
		switch {
		case err == nil:
			t.Errorf("%s answers VerifierService.BeginBoot: the gate of vm %s is open to whoever reaches it", p, vm)
		case status.Code(err) != codes.Unimplemented:
			t.Errorf("%s: BeginBoot: %v, want Unimplemented", p, err)
		default:
			t.Logf("%s: BeginBoot refused: %v", p, status.Code(err))
		}
	}
	return len(sockets)
}
