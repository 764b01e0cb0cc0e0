// Package swtpm runs one software TPM (swtpm) per VM and checks that its
// control channel answers before QEMU is started against it.
package swtpm

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
)

// Defaults and limits (contract §3.4, §4.2).
const (
	DefaultBinary = "swtpm"
	ProbeTimeout  = 5 * time.Second
	// StopGrace is the SIGTERM→SIGKILL grace for Process.Terminate.
	StopGrace = 5 * time.Second

	ctrlSocketName = "swtpm.sock"
	logName        = "swtpm.log"
	maxSocketPath  = 107
	probePoll      = 20 * time.Millisecond
	logTailBytes   = 2048
)

// ErrUnresponsive means swtpm's control channel did not answer.
var ErrUnresponsive = errors.New("vtpm not responding")

// cmdGetCapability is CMD_GET_CAPABILITY of swtpm's control protocol; the
// answer is a uint32 result code and a uint32 capability mask.
const cmdGetCapability = 1

// Config is one VM's swtpm.
type Config struct {
	Binary     string // default DefaultBinary
	StateDir   string // the VM's tpm/ directory, kept across boots
	CtrlSocket string // default <StateDir>/swtpm.sock
	LogFile    string // default <StateDir>/swtpm.log
	// Linger keeps swtpm running after QEMU closes the data channel (no
	// --terminate), so that the host can read the PCRs a boot left
	// (ReadPCRs); the caller then ends it.
	Linger bool
}

// WithDefaults fills in the defaults and makes the paths absolute (swtpm
// resolves relative ones against its own working directory).
func (c Config) WithDefaults() Config {
	if c.Binary == "" {
		c.Binary = DefaultBinary
	}
	if c.StateDir == "" {
		return c // invalid; Start says so
	}
	c.StateDir = abs(c.StateDir)
	if c.CtrlSocket == "" {
		c.CtrlSocket = filepath.Join(c.StateDir, ctrlSocketName)
	}
	if c.LogFile == "" {
		c.LogFile = filepath.Join(c.StateDir, logName)
	}
	c.CtrlSocket, c.LogFile = abs(c.CtrlSocket), abs(c.LogFile)
	return c
}

func abs(p string) string {
	if p == "" {
		return ""
	}
	if a, err := filepath.Abs(p); err == nil {
		return a
	}
	return filepath.Clean(p)
}

// Args is swtpm's argv (without the binary). not-need-init because the
// firmware sends TPM2_Startup itself; --terminate ends swtpm when QEMU closes
// the data channel.
func Args(cfg Config) []string {
	cfg = cfg.WithDefaults()
	args := []string{
		"socket", "--tpm2",
		"--tpmstate", "dir=" + cfg.StateDir,
		"--ctrl", "type=unixio,path=" + cfg.CtrlSocket,
		"--log", "file=" + cfg.LogFile + ",level=1",
		"--flags", "not-need-init",
	}
	if !cfg.Linger {
		args = append(args, "--terminate")
	}
	return args
}

// PrevLogFile is where Start moves the previous run's log.
func PrevLogFile(logFile string) string {
	return strings.TrimSuffix(logFile, ".log") + ".prev.log"
}

// Start starts swtpm for cfg and waits (up to ProbeTimeout, or ctx) until its
// control channel answers. The caller must not have a live swtpm on the same
// control socket: its stale socket file is removed.
func Start(ctx context.Context, cfg Config) (*proc.Process, error) {
	cfg = cfg.WithDefaults()
	if err := validate(cfg); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("swtpm state dir: %w", err)
	}
	if err := os.Chmod(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("swtpm state dir: %w", err)
	}
	if err := os.Rename(cfg.LogFile, PrevLogFile(cfg.LogFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("rotate swtpm log: %w", err)
	}
	if err := removeStaleSocket(cfg.CtrlSocket); err != nil {
		return nil, err
	}
	logf, err := os.OpenFile(cfg.LogFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("swtpm log: %w", err)
	}
	defer logf.Close() // the child holds its own copy

	cmd := exec.Command(cfg.Binary, Args(cfg)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	p, err := proc.Start(cmd)
	if err != nil {
		return nil, fmt.Errorf("start swtpm: %w", err)
	}

	// Stop probing as soon as swtpm dies instead of waiting for the timeout.
	probeCtx, cancel := p.While(ctx)
	defer cancel()
	if err := probe(probeCtx, cfg.CtrlSocket); err != nil {
		exited := p.Exited()
		p.Terminate(StopGrace)
		why := err.Error()
		if exited {
			code, _ := p.ExitCode()
			why = fmt.Sprintf("swtpm exited with code %d before answering", code)
		}
		return nil, fmt.Errorf("%w: %s; log: %s", ErrUnresponsive, why, tail(cfg.LogFile))
	}
	return p, nil
}

func validate(cfg Config) error {
	if cfg.StateDir == "" || cfg.StateDir == "/" {
		return apierr.Errorf(apierr.InvalidRequest, "swtpm state dir is required")
	}
	if len(cfg.CtrlSocket) > maxSocketPath {
		return apierr.Errorf(apierr.InvalidRequest, "swtpm control socket path is %d bytes, longer than %d: %s", len(cfg.CtrlSocket), maxSocketPath, cfg.CtrlSocket)
	}
	// swtpm's option parser splits at commas and has no escape.
	for _, p := range []string{cfg.StateDir, cfg.CtrlSocket, cfg.LogFile} {
		if strings.ContainsAny(p, ",\x00") {
			return apierr.Errorf(apierr.InvalidRequest, "swtpm path %q contains a comma or NUL", p)
		}
	}
	return nil
}

func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return err
	case fi.Mode().Type() != fs.ModeSocket:
		return fmt.Errorf("swtpm control socket %s exists and is not a socket", path)
	}
	return os.Remove(path)
}

// Probe sends CMD_GET_CAPABILITY on the control socket and waits for the
// 8-byte answer, retrying while the socket does not accept yet. It gives up
// after ProbeTimeout or when ctx ends; the error then wraps ErrUnresponsive.
//
// swtpm serves one control client at a time and QEMU keeps its control
// connection open, so an swtpm that a running QEMU uses never answers a
// probe (measured with swtpm 0.7.1): probe only an swtpm without its QEMU.
func Probe(ctx context.Context, ctrlSocket string) error {
	if err := probe(ctx, ctrlSocket); err != nil {
		return fmt.Errorf("%w: %v", ErrUnresponsive, err)
	}
	return nil
}

func probe(ctx context.Context, ctrlSocket string) error {
	ctx, cancel := context.WithTimeout(ctx, ProbeTimeout)
	defer cancel()
	var last error
	for {
		if last = probeOnce(ctx, ctrlSocket); last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %v (%v)", ctrlSocket, last, ctx.Err())
		case <-time.After(probePoll):
		}
	}
}

func probeOnce(ctx context.Context, socket string) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		return err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	if err := binary.Write(c, binary.BigEndian, uint32(cmdGetCapability)); err != nil {
		return err
	}
	var resp [8]byte
	if _, err := io.ReadFull(c, resp[:]); err != nil {
		return fmt.Errorf("read capability answer: %w", err)
	}
	if rc := binary.BigEndian.Uint32(resp[:4]); rc != 0 {
		return fmt.Errorf("capability answer: result code %#x", rc)
	}
	return nil
}

// tail returns the end of the log for error messages.
func tail(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > logTailBytes {
		_, _ = f.Seek(-logTailBytes, io.SeekEnd)
	}
	b, _ := io.ReadAll(f)
	s := strings.TrimSpace(string(b))
	if s == "" {
		return "(empty)"
	}
	return s
}
