package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// forkVM is the part of a fork's record the test looks at.
type forkVM struct {
	ID         string `json:"id"`
	Name       string `json:"name"`
	State      string `json:"state"`
	IP         string `json:"ip"`
	MAC        string `json:"mac"`
	ForkedFrom string `json:"forkedFrom"`
	LastError  string `json:"lastError"`
	Tpm        *struct {
		AkFingerprint string `json:"akFingerprint"`
		EkFingerprint string `json:"ekFingerprint"`
	} `json:"tpm"`
}

// forkAttestation is GET /vms/{id}/attestation.
type forkAttestation struct {
	AkFingerprint string `json:"akFingerprint"`
	ForkedFrom    string `json:"forkedFrom"`
	Ready         *struct {
		Verified bool   `json:"verified"`
		Message  string `json:"message"`
	} `json:"ready"`
}

func (a api) forkRecord(id string) forkVM {
	a.t.Helper()
	code, _, b := cluster.Do(a.t, "GET", a.base+"/vms/"+id, "")
	var v forkVM
	if code != 200 || json.Unmarshal(b, &v) != nil {
		a.t.Fatalf("get %s: %d %s", id, code, b)
	}
	return v
}

func (a api) attestationOf(id string) forkAttestation {
	a.t.Helper()
	code, _, b := cluster.Do(a.t, "GET", a.base+"/vms/"+id+"/attestation", "")
	var v forkAttestation
	if code != 200 || json.Unmarshal(b, &v) != nil {
		a.t.Fatalf("attestation of %s: %d %s", id, code, b)
	}
	return v
}

// forks is POST /vms/{id}/fork's answer.
type forks struct {
	Vms          []forkVM `json:"vms"`
	PauseSeconds float64  `json:"pauseSeconds"`
}

// fork forks the VM id into count VMs, waiting for them to be ready.
func (a api) fork(id string, count int) forks {
	a.t.Helper()
	code, _, b := cluster.Do(a.t, "POST", a.base+"/vms/"+id+"/fork", fmt.Sprintf(`{"count":%d}`, count))
	var resp forks
	if code != 200 || json.Unmarshal(b, &resp) != nil || len(resp.Vms) != count {
		a.t.Fatalf("fork: %d %s", code, b)
	}
	a.t.Logf("parent paused %.3fs for the snapshot", resp.PauseSeconds)
	return resp
}

// TestFork forks a running, attested test guest twice (issue 28): the
// forks keep the parent's memory (a file in its tmpfs, a process started
// before the fork still counting), take their own name, MAC, address and
// hostname, and their vTPMs are their own: distinct AKs, each verified as a
// fork of the parent; a quote the parent's AK signs over a fork's nonce is
// refused, and the reverse. Deleting the parent leaves the forks running.
func TestFork(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, LearnGolden: true})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })

	parent := a.vm("POST", "/vms", `{"name":"origin","image":"test-guest","memory_mib":512,"cpus":1,"user_data":`+ignitionFile("/etc/origin", "from the parent's user-data")+`}`, 201)
	// A process of its own session, so the exec's end does not take it.
	if r := a.sh(parent.ID, "echo before-the-fork > /tmp/marker; setsid sh -c 'echo $$ > /tmp/counter.pid; i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done' >/dev/null 2>&1 </dev/null &"); r.ExitCode != 0 {
		t.Fatalf("parent setup: %+v", r)
	}
	cluster.Eventually(t, 10*time.Second, "the parent's counter", func() error {
		if r := a.sh(parent.ID, "kill -0 $(cat /tmp/counter.pid) && test $(cat /tmp/counter) -gt 2"); r.ExitCode != 0 {
			return fmt.Errorf("%+v", r)
		}
		return nil
	})
	parentRec := a.forkRecord(parent.ID)

	resp := a.fork(parent.ID, 2)
	if resp.PauseSeconds <= 0 {
		t.Errorf("pause %v", resp.PauseSeconds)
	}
	aks := map[string]string{parentRec.Tpm.AkFingerprint: parent.ID}
	for _, f := range resp.Vms {
		if f.State != "ready" || f.ForkedFrom != parent.ID || f.ID == parent.ID || f.IP == parentRec.IP || f.MAC == parentRec.MAC ||
			!strings.HasPrefix(f.Name, "origin-fork-") || f.Tpm == nil {
			t.Fatalf("fork: %+v (parent %+v)", f, parentRec)
		}
		if other, dup := aks[f.Tpm.AkFingerprint]; dup {
			t.Errorf("fork %s has the AK of %s", f.ID, other)
		}
		aks[f.Tpm.AkFingerprint] = f.ID
		if f.Tpm.EkFingerprint == "" {
			t.Errorf("fork %s has no EK", f.ID)
		}

		if code, _, b := cluster.Do(t, "GET", a.base+"/vms/"+f.ID+"/console?lines=40", ""); code == 200 {
			var c struct{ Console string }
			_ = json.Unmarshal(b, &c)
			for _, l := range strings.Split(c.Console, "\n") {
				if strings.Contains(l, "fork") {
					t.Logf("fork %s console: %s", f.ID, l)
				}
			}
		}
		// The parent's memory: its files and a process it started.
		if r := a.exec(f.ID, "cat", "/tmp/marker", "/etc/origin"); r.Stdout != "before-the-fork\nfrom the parent's user-data" {
			t.Errorf("fork %s files: %+v", f.ID, r)
		}
		counter := func() int {
			r := a.sh(f.ID, "kill -0 $(cat /tmp/counter.pid) && cat /tmp/counter")
			n, err := strconv.Atoi(strings.TrimSpace(r.Stdout))
			if r.ExitCode != 0 || err != nil {
				t.Fatalf("fork %s counter: %+v", f.ID, r)
			}
			return n
		}
		first := counter()
		cluster.Eventually(t, 10*time.Second, "the parent's process counting on in fork "+f.ID, func() error {
			if n := counter(); n <= first {
				return fmt.Errorf("counter %d, was %d", n, first)
			}
			return nil
		})
		if r := a.exec(f.ID, "hostname"); strings.TrimSpace(r.Stdout) != f.Name {
			t.Errorf("fork %s hostname: %+v", f.ID, r)
		}

		// Its own vTPM, verified as a fork of the parent.
		att := a.attestationOf(f.ID)
		if att.ForkedFrom != parent.ID || att.AkFingerprint != f.Tpm.AkFingerprint || att.Ready == nil || !att.Ready.Verified {
			t.Errorf("fork %s attestation: %+v", f.ID, att)
		}
	}

	// Cross-signed quotes: the parent's AK over a fork's nonce, submitted
	// by the fork; a fork's AK over the parent's nonce, submitted by the
	// parent. Both refused.
	fork := resp.Vms[0]
	crossQuote := func(signer, victim string) string {
		t.Helper()
		var n execJSON
		// busybox nc half-closes after the request: the IMDS may see the
		// client gone before attestation answered. Asked again then.
		cluster.Eventually(t, 30*time.Second, "a nonce for "+victim, func() error {
			if n = a.sh(victim, imdsFunc+"imds attest/nonce"); n.ExitCode != 0 || len(strings.TrimSpace(n.Stdout)) != 64 {
				return fmt.Errorf("%+v", n)
			}
			return nil
		})
		q := a.sh(signer, "/init attest --stage=ready --print --nonce "+strings.TrimSpace(n.Stdout))
		if q.ExitCode != 0 || !json.Valid([]byte(q.Stdout)) {
			t.Fatalf("quote in %s: %+v", signer, q)
		}
		r := a.sh(victim, "cat > /tmp/cross.json <<'EOF'\n"+q.Stdout+"\nEOF\nwget -S -O - --post-file /tmp/cross.json http://169.254.169.254/giantswarm/v1/attest/quote 2>&1")
		return r.Stdout
	}
	for _, c := range []struct{ signer, victim string }{{parent.ID, fork.ID}, {fork.ID, parent.ID}} {
		out := crossQuote(c.signer, c.victim)
		if strings.Contains(out, " 200 ") || !strings.Contains(out, "403") {
			t.Errorf("a quote by %s's AK submitted by %s was not refused: %s", c.signer, c.victim, out)
		}
	}
	for id, ak := range map[string]string{fork.ID: fork.Tpm.AkFingerprint, parent.ID: parentRec.Tpm.AkFingerprint} {
		if att := a.attestationOf(id); att.AkFingerprint != ak {
			t.Errorf("%s's pinned AK changed to %s after a cross-signed quote", id, att.AkFingerprint)
		}
	}

	// A fork suspends and resumes (the resume talks to its swtpm itself),
	// and its vTPM control channel outlives the hypervisor (the proxy is a
	// process of its own): after a SIGKILL and restart it suspends and
	// resumes again, keeping its memory and its AK.
	if code, _, b := cluster.Do(t, "POST", a.base+"/vms/"+fork.ID+"/suspend", ""); code != 200 {
		pl, _ := os.ReadFile(filepath.Join(c.StateDir, "vms", fork.ID, "tpm-proxy.log"))
		ql, _ := os.ReadFile(filepath.Join(c.StateDir, "vms", fork.ID, "qemu.log"))
		t.Fatalf("suspend of a fork: %d %s\nproxy:\n%s\nqemu:\n%s", code, b, pl, ql)
	}
	a.vm("POST", "/vms/"+fork.ID+"/resume", "", 200)
	c.StopService("hypervisor")
	c.StartService("hypervisor")
	c.WaitReady(30 * time.Second)
	a.vm("POST", "/vms/"+fork.ID+"/suspend", "", 200)
	if v := a.vm("POST", "/vms/"+fork.ID+"/resume", "", 200); v.State != "ready" {
		t.Errorf("fork after resume: %+v", v)
	}
	if r := a.exec(fork.ID, "cat", "/tmp/marker"); strings.TrimSpace(r.Stdout) != "before-the-fork" {
		t.Errorf("fork after a restart, suspend and resume: %+v", r)
	}
	if r := a.forkRecord(fork.ID); r.Tpm.AkFingerprint != fork.Tpm.AkFingerprint {
		t.Errorf("fork's AK changed: %s, was %s", r.Tpm.AkFingerprint, fork.Tpm.AkFingerprint)
	}

	// Bad requests change nothing.
	expectError(t, "POST", a.base+"/vms/"+parent.ID+"/fork", `{"count":17}`, 400, apierr.InvalidRequest)
	expectError(t, "POST", a.base+"/vms/0badf00d/fork", `{}`, 404, apierr.NotFound)

	// The parent can go; its forks stay.
	a.vm("DELETE", "/vms/"+parent.ID, "", 204)
	for _, f := range resp.Vms {
		if r := a.exec(f.ID, "cat", "/tmp/marker"); strings.TrimSpace(r.Stdout) != "before-the-fork" {
			t.Errorf("fork %s after the parent's delete: %+v", f.ID, r)
		}
	}
}
