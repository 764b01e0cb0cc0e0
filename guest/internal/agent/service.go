package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/guest/internal/initsys"
	"github.com/giantswarm/vm-manager/guest/internal/installer"
	"github.com/giantswarm/vm-manager/guest/internal/sdnotify"
	"github.com/giantswarm/vm-manager/guest/internal/smbios"
)

// The commands below are vm-agent's part in a real OS (the vm-base image,
// guest/os): systemd is PID 1 there and runs each as a unit, so each does
// one step and exits, or (Up) stays for the reports. Their console lines
// carry the same "vm-agent: " prefix as the test guest's.

// InitrdAttestResult is where the initrd unit leaves how its quote ended;
// /run survives the switch to the installed root, so Up reports it.
const InitrdAttestResult = "/run/vm-agent/initrd-attest"

// Install is the installer of a systemd initrd: the unit that runs it
// (ConditionCredential=vm.install-target) powers the machine off when it
// succeeds and resets it when it fails, which the host reads as the
// install's outcome. The target comes from the unit's credentials
// ($CREDENTIALS_DIRECTORY, ImportCredential=), else from SMBIOS.
func Install(con *Console) error {
	target, err := credential(installer.Credential)
	if err != nil {
		return err
	}
	return install(con, target, InstallDiskWait)
}

// credential reads a system credential: the unit's imported copy first, then
// the SMBIOS type 11 strings (vm-agent's own parser).
func credential(name string) (string, error) {
	if dir := os.Getenv("CREDENTIALS_DIRECTORY"); dir != "" {
		if b, err := os.ReadFile(filepath.Join(dir, name)); err == nil {
			return strings.TrimSpace(string(b)), nil
		}
	}
	creds, errs := smbios.ReadCredentials(smbios.DefaultEntriesDir)
	if v, ok := creds[name]; ok {
		return strings.TrimSpace(string(v)), nil
	}
	return "", fmt.Errorf("no %s credential (%v)", name, errors.Join(errs...))
}

// Provision sets the hostname and root's authorized keys from the IMDS, as
// the test guest's PID 1 does. Nothing it cannot get fails the boot.
func Provision(ctx context.Context, con *Console, imdsURL string) {
	p := &provisioner{
		con:         con,
		imds:        imdsclient.New(imdsURL),
		root:        "/",
		setHostname: initsys.SetHostname,
	}
	p.hostname(ctx)
	p.publicKeys(ctx)
}

// Up is the end of a real OS's boot: the ready-stage quote (after
// systemd-pcrphase extended "ready" and the Kubernetes extension was
// measured), READY=1 to the host, then a report every ReportInterval until
// ctx ends. It returns an error only when READY=1 could not be sent.
func Up(ctx context.Context, con *Console, imdsURL, tpmPath string) error {
	res := bootResults{initrd: readAttestResult(InitrdAttestResult), ready: attestSkipped}
	if cmdlineValue("/proc/cmdline", "vm-agent.attest") == "off" {
		con.Printf("attestation off (vm-agent.attest=off)")
	} else {
		res.ready = tpmAttester(con, imdsURL, tpmPath)(ctx, attest.StageReady)
	}
	cred, _ := credential(CredNotifySocket)
	s, err := sdnotify.Select(ctx, sdnotify.DefaultPaths, portWait(), cred)
	if err != nil {
		return fmt.Errorf("READY=1: %w", err)
	}
	msg, err := sdnotify.Message("READY=1", "STATUS=ready")
	if err != nil {
		return err
	}
	// The console line first: a host that reads the console once READY=1
	// arrives must find it there. Under systemd stdout reaches the console
	// through journald, later; /dev/console is written at once.
	line := fmt.Sprintf("ready (%s after kernel start)", uptime())
	if f, err := os.OpenFile("/dev/console", os.O_WRONLY|os.O_APPEND, 0); err == nil {
		NewConsole(f).Printf("%s", line)
		f.Close()
	} else {
		con.Printf("%s", line)
	}
	sent := make(chan error, 1)
	go func() { sent <- s.Send(msg) }()
	select {
	case err = <-sent:
	case <-time.After(time.Minute):
		err = fmt.Errorf("%s: not delivered within a minute", s)
	}
	s.Close()
	if err != nil {
		return fmt.Errorf("READY=1: %w", err)
	}
	uploadReports(ctx, con, imdsclient.New(imdsURL), "/proc", res, ReportInterval)
	return nil
}

// RecordAttestResult writes how a stage's quote ended (the exit code of
// `vm-agent attest`) where Up finds it.
func RecordAttestResult(path string, code int) {
	r := attestFailed
	switch code {
	case attest.ExitVerified:
		r = attestVerified
	case attest.ExitRejected:
		r = attestRejected
	}
	_ = os.MkdirAll(filepath.Dir(path), 0o755)
	_ = os.WriteFile(path, []byte(r.String()+"\n"), 0o644)
}

func readAttestResult(path string) attestResult {
	b, err := os.ReadFile(path)
	if err != nil {
		return attestSkipped
	}
	for _, r := range []attestResult{attestVerified, attestRejected, attestFailed} {
		if strings.TrimSpace(string(b)) == r.String() {
			return r
		}
	}
	return attestSkipped
}
