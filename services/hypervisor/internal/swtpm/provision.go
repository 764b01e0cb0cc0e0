package swtpm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// The provisioning swtpm's own socket and log, next to the VM's state.
const (
	provisionSocketName = "provision.sock"
	provisionLogName    = "swtpm-provision.log"
)

// Identity is a vTPM's endorsement and attestation keys, read by the host
// from the vTPM itself before the guest runs. A key read that way is the
// VM's: the AK template says fixedTPM and sensitiveDataOrigin, so the TPM
// generated it and it never leaves this state, and restricted, so it signs
// only what the TPM itself attests (quotes of the real PCRs).
type Identity struct {
	EK *vtpm.Key
	AK *vtpm.Key
	// EKCertificate is the DER certificate at vtpm.EKCertIndex, issued by
	// the host's vTPM CA; nil when provisioned without one.
	EKCertificate []byte
	// Created lists what this provisioning made or replaced ("ek", "ak",
	// "ek certificate"); empty when the vTPM already held all of it.
	Created []string
}

// Provision runs swtpm on the VM's state with a data channel of the host's
// own (no QEMU may use the state meanwhile) and makes sure it holds:
//   - at vtpm.EKHandle the EK of the TCG's default RSA template;
//   - at vtpm.AKHandle an AK of vtpm.AKTemplate, the key guests quote with;
//   - with a CA, an EK certificate for that EK at vtpm.EKCertIndex.
//
// What is missing is created; a key at either handle that does not match its
// template (a guest may put anything there) is evicted and replaced. It runs
// before every launch, so a boot always quotes with a key the host has read
// from the vTPM, whatever the previous boot's guest did to it.
func Provision(ctx context.Context, cfg Config, ca *CA, vmID string) (*Identity, error) {
	cfg = cfg.WithDefaults()
	if err := validate(cfg); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("swtpm state dir: %w", err)
	}
	sock := filepath.Join(cfg.StateDir, provisionSocketName)
	if len(sock) > maxSocketPath {
		return nil, fmt.Errorf("swtpm provisioning socket path is %d bytes, longer than %d: %s", len(sock), maxSocketPath, sock)
	}
	if err := removeStaleSocket(sock); err != nil {
		return nil, err
	}
	logPath := filepath.Join(cfg.StateDir, provisionLogName)
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("swtpm provisioning log: %w", err)
	}
	defer logf.Close()
	// startup-clear: swtpm sends TPM2_Startup itself, as the firmware would.
	cmd := exec.Command(cfg.Binary, "socket", "--tpm2",
		"--tpmstate", "dir="+cfg.StateDir,
		"--server", "type=unixio,path="+sock,
		"--log", "file="+logPath+",level=1",
		"--flags", "not-need-init,startup-clear")
	cmd.Stdout, cmd.Stderr = logf, logf
	p, err := proc.Start(cmd)
	if err != nil {
		return nil, fmt.Errorf("start swtpm for provisioning: %w", err)
	}
	defer func() {
		p.Terminate(StopGrace)
		_ = os.Remove(sock)
	}()

	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	t, err := DialData(ctx, sock, p)
	if err != nil {
		return nil, fmt.Errorf("%w: provisioning channel: %v; log: %s", ErrUnresponsive, err, tail(logPath))
	}
	defer t.Close()
	stop := context.AfterFunc(ctx, func() { t.Close() })
	defer stop()

	id, err := provision(t, ca, vmID)
	if err != nil {
		return nil, err
	}
	// An orderly shutdown, as a guest's power-off would end it.
	if _, err := (tpm2.Shutdown{ShutdownType: tpm2.TPMSUClear}).Execute(t); err != nil {
		return nil, fmt.Errorf("TPM2_Shutdown: %w", err)
	}
	return id, nil
}

// DialData connects to the data channel of swtpm process p once it listens.
func DialData(ctx context.Context, sock string, p *proc.Process) (transport.TPMCloser, error) {
	for {
		c, err := net.DialTimeout("unix", sock, time.Second)
		if err == nil {
			return vtpm.FromConn(c), nil
		}
		select {
		case <-p.Done():
			code, _ := p.ExitCode()
			return nil, fmt.Errorf("swtpm exited with code %d", code)
		case <-ctx.Done():
			return nil, fmt.Errorf("%s: %v (%v)", sock, err, ctx.Err())
		case <-time.After(probePoll):
		}
	}
}

func provision(t transport.TPM, ca *CA, vmID string) (*Identity, error) {
	id := &Identity{}
	ek, created, err := ensureKey(t, vtpm.EKHandle, vtpm.EKTemplate(), vtpm.PersistEK)
	if err != nil {
		return nil, fmt.Errorf("endorsement key: %w", err)
	}
	if id.EK = ek; created {
		id.Created = append(id.Created, "ek")
	}
	ak, created, err := ensureKey(t, vtpm.AKHandle, vtpm.AKTemplate(), vtpm.CreateAK)
	if err != nil {
		return nil, fmt.Errorf("attestation key: %w", err)
	}
	if id.AK = ak; created {
		id.Created = append(id.Created, "ak")
	}
	if ca != nil {
		cert, created, err := ca.ensureEKCert(t, id.EK, vmID)
		if err != nil {
			return nil, fmt.Errorf("ek certificate: %w", err)
		}
		if id.EKCertificate = cert; created {
			id.Created = append(id.Created, "ek certificate")
		}
	}
	return id, nil
}

// ensureKey returns the key at h when it matches tmpl; otherwise it evicts
// whatever is there and makes a new one with create. created says it did.
func ensureKey(t transport.TPM, h tpm2.TPMHandle, tmpl tpm2.TPMTPublic, create func(transport.TPM) error) (*vtpm.Key, bool, error) {
	k, err := vtpm.ReadKey(t, h)
	switch {
	case err == nil && vtpm.MatchesTemplate(k.Parsed, tmpl):
		return k, false, nil
	case err == nil:
		if err := vtpm.Evict(t, k); err != nil {
			return nil, false, err
		}
	case !vtpm.IsEmptyHandle(err):
		return nil, false, err
	}
	if err := create(t); err != nil {
		return nil, false, err
	}
	if k, err = vtpm.ReadKey(t, h); err != nil {
		return nil, false, err
	}
	if !vtpm.MatchesTemplate(k.Parsed, tmpl) {
		return nil, false, errors.New("the new key does not match its template")
	}
	return k, true, nil
}
