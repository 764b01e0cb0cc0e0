package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/ignition"
	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/guest/internal/initsys"
	"github.com/giantswarm/vm-manager/guest/internal/sysext"
	"github.com/giantswarm/vm-manager/pkg/measure"
)

// Where provisioning writes, relative to the provisioner's root ("/" at boot).
const (
	AuthorizedKeysPath = "/root/.ssh/authorized_keys"
	UserDataPath       = "/run/vm-agent/user-data"
	// UserDataWait bounds the wait for a gated (503) /user-data.
	UserDataWait = 60 * time.Second
)

// attestResult is how one attestation stage ended.
type attestResult int

const (
	attestVerified attestResult = iota
	attestRejected
	attestFailed // any other error: continue
	attestSkipped
)

// provisioner runs the network-dependent boot steps against the IMDS.
type provisioner struct {
	con          *Console
	imds         *imdsclient.Client
	root         string // "/" at boot; a temp dir in tests
	attest       func(ctx context.Context, stage string) attestResult
	attestOff    bool
	credHostname bool // the SMBIOS credential set the hostname: IMDS's is not used
	setHostname  func(string) error
	userDataWait time.Duration
	phases       *phases                             // nil or without an extender: no boot phases
	sysext       func(context.Context) sysext.Result // nil: no Kubernetes sysext step
}

func (p *provisioner) path(abs string) string {
	return filepath.Join(p.root, filepath.FromSlash(abs))
}

// run: the enter-initrd phase, hostname, public keys, initrd attestation,
// user-data (+ Ignition files), the leave-initrd and sysinit phases, the
// Kubernetes sysext, the ready phase, ready attestation. Every step failing
// only prints: the VM still becomes ready. The attestation and sysext results
// go into the reports.
func (p *provisioner) run(ctx context.Context) bootResults {
	p.phases.enter(measure.WordEnterInitrd)
	p.hostname(ctx)
	p.publicKeys(ctx)

	res := bootResults{initrd: attestSkipped, ready: attestSkipped}
	if p.attestOff {
		p.con.Printf("attestation off (vm-agent.attest=off)")
	} else {
		res.initrd = p.attest(ctx, attest.StageInitrd)
	}
	// The IMDS decides whether user-data is released: a VM that does not
	// require attestation gets it even after a rejected quote. After a
	// rejection a gated answer will not change, so it is asked once.
	if waited := p.userData(ctx, res.initrd == attestRejected); waited {
		// A warm pool's member waited here, suspended, for a claim: the
		// hostname and keys it read before are the member's, the claimer's
		// are served now (harmless re-reads after a slow attestation).
		p.hostname(ctx)
		p.publicKeys(ctx)
	}
	p.phases.enter(measure.WordLeaveInitrd)
	p.phases.enter(measure.WordSysinit)
	if p.sysext != nil {
		res.sysext = p.sysext(ctx)
	}
	p.phases.enter(measure.WordReady)
	if !p.attestOff {
		res.ready = p.attest(ctx, attest.StageReady)
	}
	return res
}

// offlinePhases is the phase path of a boot without an IMDS.
func offlinePhases(ph *phases) {
	for _, w := range measure.PhaseWords(measure.PhaseReady) {
		ph.enter(w)
	}
}

func (p *provisioner) hostname(ctx context.Context) {
	if p.credHostname {
		return // the credential wins (already set and printed)
	}
	h, err := p.imds.Hostname(ctx)
	switch {
	case errors.Is(err, imdsclient.ErrNotFound) || (err == nil && h == ""):
		p.con.Printf("imds: no hostname")
	case err != nil:
		p.con.Printf("warning: imds hostname: %v", err)
	default:
		if err := p.setHostname(h); err != nil {
			p.con.Printf("warning: hostname %q from imds: %v", h, err)
			return
		}
		p.con.Printf("hostname %s (from imds)", h)
	}
}

func (p *provisioner) publicKeys(ctx context.Context) {
	keys, err := p.imds.PublicKeys(ctx)
	if err != nil {
		p.con.Printf("warning: imds public keys: %v", err)
		if len(keys) == 0 {
			return
		}
	}
	if len(keys) == 0 {
		p.con.Printf("imds: no public keys")
		return
	}
	var b strings.Builder
	for _, k := range keys {
		b.WriteString(k)
		b.WriteString("\n")
	}
	dst := p.path(AuthorizedKeysPath)
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		p.con.Printf("warning: public keys: %v", err)
		return
	}
	if err := writeFileAtomic(dst, []byte(b.String()), 0o600); err != nil {
		p.con.Printf("warning: public keys: %v", err)
		return
	}
	descr := make([]string, len(keys))
	for i, k := range keys {
		descr[i] = keySummary(k)
	}
	p.con.Printf("public keys: %d written to %s (%s)", len(keys), AuthorizedKeysPath, strings.Join(descr, ", "))
}

// keySummary is "<type> <comment>" (public, but long: the blob is left out).
func keySummary(k string) string {
	f := strings.Fields(k)
	switch {
	case len(f) >= 3:
		return f[0] + " " + strings.Join(f[2:], " ")
	case len(f) >= 1:
		return f[0]
	}
	return "?"
}

// userData fetches, stores and applies the user-data; waited says whether
// the IMDS answered 503 at least once before.
func (p *provisioner) userData(ctx context.Context, rejected bool) (waited bool) {
	wait := p.userDataWait
	if wait <= 0 {
		wait = UserDataWait
	}
	if rejected {
		wait = 0 // ask once
	}
	gated := 0
	data, err := p.imds.UserData(ctx, wait, func(reason string, retry time.Duration) {
		gated++
		if gated == 1 || gated%10 == 0 {
			p.con.Printf("user-data gated (503: %s); retrying in %s", reason, retry.Round(100*time.Millisecond))
		}
	})
	switch {
	case errors.Is(err, imdsclient.ErrNoUserData):
		p.con.Printf("no user-data")
		return gated > 0
	case errors.Is(err, imdsclient.ErrNotFound):
		p.con.Printf("no user-data (404)")
		return gated > 0
	case errors.Is(err, imdsclient.ErrGated) && rejected:
		p.con.Printf("user-data stays gated: the initrd attestation was rejected")
		return gated > 0
	case errors.Is(err, imdsclient.ErrGated):
		p.con.Printf("giving up on user-data: %v", err)
		return gated > 0
	case err != nil:
		p.con.Printf("warning: user-data: %v", err)
		return gated > 0
	}
	dst := p.path(UserDataPath)
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		p.con.Printf("warning: user-data: %v", err)
		return gated > 0
	}
	if err := writeFileAtomic(dst, data, 0o600); err != nil {
		p.con.Printf("warning: user-data: %v", err)
		return gated > 0
	}
	p.con.Printf("user-data: %d bytes written to %s", len(data), UserDataPath)

	cfg, ignored, err := ignition.Parse(data)
	if err != nil {
		p.con.Printf("user-data not applied: %v", err)
		return gated > 0
	}
	if len(ignored) > 0 {
		p.con.Printf("ignition: ignoring %s (only storage.files is applied)", strings.Join(ignored, ", "))
	}
	written, err := ignition.Apply(cfg, p.root)
	for _, w := range written {
		p.con.Printf("ignition: wrote %s (%04o, %d bytes)", w.Path, w.Mode, w.Size)
	}
	if err != nil {
		p.con.Printf("warning: ignition: %v", err)
		return gated > 0
	}
	p.con.Printf("ignition: %d files written", len(written))
	return gated > 0
}

// tpmAttester runs `vm-agent attest` in-process (internal/attest) and sends its
// output to the console, a line at a time.
func tpmAttester(con *Console, imdsURL, tpmPath string) func(context.Context, string) attestResult {
	return func(ctx context.Context, stage string) attestResult {
		if _, err := os.Stat(tpmPath); err != nil {
			con.Printf("attestation (%s) skipped: no TPM: %v", stage, err)
			return attestSkipped
		}
		con.Printf("attestation (%s stage)", stage)
		w := &lineWriter{emit: func(line string) {
			if rest, ok := strings.CutPrefix(line, "vm-agent attest: "); ok {
				line = "attest " + stage + ": " + rest
			}
			con.Printf("%s", line)
		}}
		code := attest.Run(ctx, attest.Config{
			Stage:            stage,
			IMDSURL:          imdsURL,
			TPMPath:          tpmPath,
			Timeout:          attest.DefaultTimeout,
			EventLogPath:     attest.DefaultEventLogPath,
			UserspaceLogPath: attest.DefaultUserspaceLogPath,
			Stdout:           w,
			Stderr:           w,
		})
		w.flush()
		switch code {
		case attest.ExitVerified:
			return attestVerified
		case attest.ExitRejected:
			return attestRejected
		}
		return attestFailed
	}
}

// lineWriter turns writes into whole lines.
type lineWriter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	emit func(string)
}

func (w *lineWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(b)
	for {
		line, err := w.buf.ReadString('\n')
		if err != nil {
			w.buf.WriteString(line) // incomplete: keep it
			return len(b), nil
		}
		w.emit(strings.TrimRight(line, "\r\n"))
	}
}

func (w *lineWriter) flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.buf.Len() > 0 {
		w.emit(w.buf.String())
		w.buf.Reset()
	}
}

func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return err
	}
	if err := os.Chmod(tmp, mode); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("rename %s: %w", tmp, err)
	}
	return nil
}

// newBootProvisioner is the PID 1 configuration.
func newBootProvisioner(con *Console, credHostname, attestOff bool, ph *phases) *provisioner {
	cl := imdsclient.New(imdsclient.DefaultURL)
	return &provisioner{
		con:          con,
		imds:         cl,
		root:         "/",
		attest:       tpmAttester(con, imdsclient.DefaultURL, attest.DefaultTPMPath),
		attestOff:    attestOff,
		credHostname: credHostname,
		setHostname:  initsys.SetHostname,
		userDataWait: UserDataWait,
		phases:       ph,
		sysext:       kubernetesSysext(con, cl),
	}
}
