package agent

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
)

// fakeIMDS is the host's IMDS as far as provisioning sees it. The user-data gate
// opens with a verified initrd attestation, as on the host.
type fakeIMDS struct {
	mu       sync.Mutex
	events   []string // requests and attestations, in order
	userData string   // "" → 204
	gateOpen bool
	verdict  map[string]attestResult // per stage; default verified
	// claimAfter > 0: a warm pool's member, answered 503 "asked again at
	// once" that many times; then claimed: the claimer's hostname and key.
	claimAfter int
	claimed    bool
}

func (f *fakeIMDS) log(e string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, e)
}

func (f *fakeIMDS) handler() http.Handler {
	mux := http.NewServeMux()
	text := func(s string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) { w.Write([]byte(s)) }
	}
	mux.HandleFunc("GET /giantswarm/v1/hostname", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.claimed {
			w.Write([]byte("claimer-host"))
			return
		}
		w.Write([]byte("imds-host"))
	})
	mux.HandleFunc("GET /giantswarm/v1/public-keys/2", text("ssh-ed25519 AAAAE5Nz claimer@laptop"))
	mux.HandleFunc("GET /giantswarm/v1/public-keys/", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.claimed {
			w.Write([]byte("0\n2"))
			return
		}
		w.Write([]byte("0\n1"))
	})
	mux.HandleFunc("GET /giantswarm/v1/public-keys/0", text("ssh-ed25519 AAAAC3Nz vm-manager"))
	mux.HandleFunc("GET /giantswarm/v1/public-keys/1", text("ssh-ed25519 AAAAD4Nz alice@laptop"))
	mux.HandleFunc("GET /giantswarm/v1/user-data", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		open, ud := f.gateOpen, f.userData
		member := open && f.claimAfter > 0
		if member {
			f.claimAfter--
			f.claimed = f.claimAfter == 0
		}
		f.mu.Unlock()
		switch {
		case member:
			w.Header().Set("Retry-After", "0")
			http.Error(w, "this VM waits in a warm pool", 503)
		case !open:
			w.Header().Set("Retry-After", "2")
			http.Error(w, "user-data is released after the initrd-stage attestation verifies", 503)
		case ud == "":
			w.WriteHeader(204)
		default:
			w.Write([]byte(ud))
		}
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.log(r.Method + " " + strings.TrimPrefix(r.URL.Path, "/giantswarm/v1"))
		mux.ServeHTTP(w, r)
	})
}

func (f *fakeIMDS) attest(_ context.Context, stage string) attestResult {
	f.log("attest " + stage)
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.verdict[stage]
	if !ok {
		v = attestVerified
	}
	if stage == "initrd" && v == attestVerified {
		f.gateOpen = true
	}
	return v
}

type fixture struct {
	f        *fakeIMDS
	p        *provisioner
	out      *bytes.Buffer
	hostname string
	slept    time.Duration
}

func newFixture(t *testing.T, f *fakeIMDS) *fixture {
	srv := httptest.NewServer(f.handler())
	t.Cleanup(srv.Close)
	fx := &fixture{f: f, out: &bytes.Buffer{}}
	cl := imdsclient.New(srv.URL + "/giantswarm/v1")
	now := time.Unix(1e9, 0)
	cl.Now = func() time.Time { return now.Add(fx.slept) }
	cl.Sleep = func(_ context.Context, d time.Duration) error { fx.slept += d; return nil }
	fx.p = &provisioner{
		con:          NewConsole(fx.out),
		imds:         cl,
		root:         t.TempDir(),
		attest:       f.attest,
		setHostname:  func(h string) error { fx.hostname = h; return nil },
		userDataWait: UserDataWait,
	}
	return fx
}

const userData = `{"ignition":{"version":"3.4.0"},"storage":{"files":[
 {"path":"/etc/motd","mode":420,"contents":{"source":"data:,hello%20from%20ignition%0A"}},
 {"path":"/usr/local/bin/hi","mode":493,"contents":{"source":"data:;base64,IyEvYmluL3NoCmVjaG8gaGkK"}}]}}`

func TestProvisionFullFlow(t *testing.T) {
	fx := newFixture(t, &fakeIMDS{userData: userData})
	if res := fx.p.run(context.Background()); res != (bootResults{initrd: attestVerified, ready: attestVerified}) {
		t.Errorf("results %+v", res)
	}
	out := fx.out.String()
	t.Logf("console:\n%s", out)

	// Attestation comes before user-data; the ready stage after it.
	want := []string{"GET /hostname", "GET /public-keys/", "GET /public-keys/0", "GET /public-keys/1",
		"attest initrd", "GET /user-data", "attest ready"}
	if got := strings.Join(fx.f.events, ", "); got != strings.Join(want, ", ") {
		t.Errorf("order:\n got %s\nwant %s", got, strings.Join(want, ", "))
	}
	if fx.hostname != "imds-host" {
		t.Errorf("hostname %q", fx.hostname)
	}
	keys, err := os.ReadFile(filepath.Join(fx.p.root, "root/.ssh/authorized_keys"))
	if err != nil || string(keys) != "ssh-ed25519 AAAAC3Nz vm-manager\nssh-ed25519 AAAAD4Nz alice@laptop\n" {
		t.Errorf("authorized_keys %q %v", keys, err)
	}
	mode := func(p string) os.FileMode {
		st, err := os.Stat(filepath.Join(fx.p.root, p))
		if err != nil {
			t.Error(err)
			return 0
		}
		return st.Mode().Perm()
	}
	if m := mode("root/.ssh/authorized_keys"); m != 0o600 {
		t.Errorf("authorized_keys mode %v", m)
	}
	if m := mode("root/.ssh"); m != 0o700 {
		t.Errorf(".ssh mode %v", m)
	}
	ud, err := os.ReadFile(filepath.Join(fx.p.root, "run/vm-agent/user-data"))
	if err != nil || string(ud) != userData {
		t.Errorf("user-data %q %v", ud, err)
	}
	if m := mode("run/vm-agent/user-data"); m != 0o600 {
		t.Errorf("user-data mode %v", m)
	}
	if b, _ := os.ReadFile(filepath.Join(fx.p.root, "etc/motd")); string(b) != "hello from ignition\n" {
		t.Errorf("motd %q", b)
	}
	if m := mode("usr/local/bin/hi"); m != 0o755 {
		t.Errorf("hi mode %v", m)
	}
	for _, line := range []string{
		"vm-agent: hostname imds-host (from imds)\n",
		"vm-agent: public keys: 2 written to /root/.ssh/authorized_keys (ssh-ed25519 vm-manager, ssh-ed25519 alice@laptop)\n",
		"vm-agent: user-data: " + strconv.Itoa(len(userData)) + " bytes written to /run/vm-agent/user-data\n",
		"vm-agent: ignition: wrote /etc/motd (0644, 20 bytes)\n",
		"vm-agent: ignition: wrote /usr/local/bin/hi (0755, 18 bytes)\n",
		"vm-agent: ignition: 2 files written\n",
	} {
		if !strings.Contains(out, line) {
			t.Errorf("console lacks %q", line)
		}
	}
	if fx.slept != 0 {
		t.Errorf("waited %s for released user-data", fx.slept)
	}
}

// A warm pool's member waits for its user-data after a verified initrd
// quote; once claimed, it takes the claimer's hostname and keys, which the
// IMDS serves from then on, and its user-data.
func TestProvisionPoolMemberTakesTheClaimersIdentity(t *testing.T) {
	fx := newFixture(t, &fakeIMDS{userData: userData, claimAfter: 3})
	fx.p.run(context.Background())
	if fx.hostname != "claimer-host" {
		t.Errorf("hostname %q, want the claimer's", fx.hostname)
	}
	keys, err := os.ReadFile(filepath.Join(fx.p.root, "root/.ssh/authorized_keys"))
	if err != nil || string(keys) != "ssh-ed25519 AAAAC3Nz vm-manager\nssh-ed25519 AAAAE5Nz claimer@laptop\n" {
		t.Errorf("authorized_keys %q %v", keys, err)
	}
	if ud, err := os.ReadFile(filepath.Join(fx.p.root, "run/vm-agent/user-data")); err != nil || string(ud) != userData {
		t.Errorf("user-data %q %v", ud, err)
	}
	// Retry-After 0 is a short wait, not a spin.
	if fx.slept != 3*100*time.Millisecond {
		t.Errorf("waited %s, want 3 × 100ms", fx.slept)
	}
}

// The credential's hostname wins: the IMDS's is not even fetched.
func TestProvisionCredentialHostnameWins(t *testing.T) {
	fx := newFixture(t, &fakeIMDS{})
	fx.p.credHostname = true
	fx.p.run(context.Background())
	if fx.hostname != "" || strings.Contains(strings.Join(fx.f.events, ","), "/hostname") {
		t.Errorf("imds hostname used: %q %v", fx.hostname, fx.f.events)
	}
	if !strings.Contains(fx.out.String(), "vm-agent: no user-data\n") {
		t.Errorf("console:\n%s", fx.out)
	}
}

// A rejected initrd attestation: user-data is asked for once (the gate stays
// shut, no waiting), the ready stage still runs.
func TestProvisionRejected(t *testing.T) {
	fx := newFixture(t, &fakeIMDS{userData: userData, verdict: map[string]attestResult{"initrd": attestRejected, "ready": attestFailed}})
	if res := fx.p.run(context.Background()); res != (bootResults{initrd: attestRejected, ready: attestFailed}) {
		t.Errorf("results %+v", res)
	}
	ev := strings.Join(fx.f.events, ", ")
	if strings.Count(ev, "GET /user-data") != 1 || !strings.HasSuffix(ev, "GET /user-data, attest ready") {
		t.Errorf("events %s", ev)
	}
	if !strings.Contains(fx.out.String(), "user-data stays gated: the initrd attestation was rejected") {
		t.Errorf("console:\n%s", fx.out)
	}
	if _, err := os.Stat(filepath.Join(fx.p.root, "etc/motd")); err == nil {
		t.Error("user-data applied after a rejection")
	}
}

// An attestation error (not a rejection) leaves the gate shut: the agent waits
// 60 s of Retry-After, then gives up and the VM still becomes ready.
func TestProvisionGatedGivesUp(t *testing.T) {
	fx := newFixture(t, &fakeIMDS{userData: userData, verdict: map[string]attestResult{"initrd": attestFailed}})
	fx.p.run(context.Background())
	out := fx.out.String()
	if fx.slept != UserDataWait {
		t.Errorf("waited %s", fx.slept)
	}
	if !strings.Contains(out, "vm-agent: user-data gated (503: user-data is released after the initrd-stage attestation verifies); retrying in 2s\n") ||
		!strings.Contains(out, "vm-agent: giving up on user-data: user-data still gated after 1m0s") {
		t.Errorf("console:\n%s", out)
	}
	if n := strings.Count(strings.Join(fx.f.events, ","), "GET /user-data"); n != 31 {
		t.Errorf("%d user-data requests", n)
	}
	if !strings.HasSuffix(strings.Join(fx.f.events, ","), "attest ready") {
		t.Errorf("events %v", fx.f.events)
	}
}

func TestProvisionAttestOff(t *testing.T) {
	f := &fakeIMDS{userData: userData, gateOpen: true} // e.g. --attestation=noop on the host
	fx := newFixture(t, f)
	fx.p.attestOff = true
	if res := fx.p.run(context.Background()); res != (bootResults{initrd: attestSkipped, ready: attestSkipped}) {
		t.Errorf("results %+v", res)
	}
	if strings.Contains(strings.Join(f.events, ","), "attest") {
		t.Errorf("attested: %v", f.events)
	}
	if !strings.Contains(fx.out.String(), "vm-agent: attestation off (vm-agent.attest=off)") ||
		!strings.Contains(fx.out.String(), "ignition: 2 files written") {
		t.Errorf("console:\n%s", fx.out)
	}
}

// Not Ignition: kept in /run/vm-agent/user-data, nothing applied.
func TestProvisionUserDataNotIgnition(t *testing.T) {
	fx := newFixture(t, &fakeIMDS{userData: "#!/bin/sh\necho hi\n"})
	fx.p.run(context.Background())
	if !strings.Contains(fx.out.String(), "vm-agent: user-data not applied: not an Ignition config") {
		t.Errorf("console:\n%s", fx.out)
	}
}

// The attest library's lines reach the console as they are; its own prefix becomes
// the stage.
func TestLineWriter(t *testing.T) {
	var lines []string
	w := &lineWriter{emit: func(s string) { lines = append(lines, s) }}
	w.Write([]byte("Attestation rejected: golden mis"))
	w.Write([]byte("match\nattestation verified: ok\npartial"))
	w.flush()
	if got := strings.Join(lines, "|"); got != "Attestation rejected: golden mismatch|attestation verified: ok|partial" {
		t.Errorf("%q", got)
	}
}

func TestCmdlineValue(t *testing.T) {
	p := filepath.Join(t.TempDir(), "cmdline")
	os.WriteFile(p, []byte("console=ttyS0 vm-agent.attest=off panic=-1\n"), 0o644)
	if v := cmdlineValue(p, "vm-agent.attest"); v != "off" {
		t.Errorf("%q", v)
	}
	if v := cmdlineValue(p, "vm-agent.other"); v != "" {
		t.Errorf("%q", v)
	}
}
