package swtpm

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

func needSwtpm(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath(DefaultBinary); err == nil {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("swtpm is missing (CI=true: integration tests must run)")
	}
	t.Skip("swtpm is missing: install the swtpm package to run this test")
}

// shortDir is a state directory whose socket path stays under 107 bytes.
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "vmm-swtpm-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func TestArgs(t *testing.T) {
	got := Args(Config{StateDir: "/var/lib/vmm/vms/ab/tpm"})
	want := []string{
		"socket", "--tpm2",
		"--tpmstate", "dir=/var/lib/vmm/vms/ab/tpm",
		"--ctrl", "type=unixio,path=/var/lib/vmm/vms/ab/tpm/swtpm.sock",
		"--log", "file=/var/lib/vmm/vms/ab/tpm/swtpm.log,level=1",
		"--flags", "not-need-init",
		"--terminate",
	}
	if !slices.Equal(got, want) {
		t.Errorf("Args\n got %q\nwant %q", got, want)
	}

	// Relative paths become absolute: swtpm resolves them against its own cwd.
	wd, _ := os.Getwd()
	got = Args(Config{StateDir: "tpm", CtrlSocket: "c.sock", LogFile: "l.log"})
	if got[3] != "dir="+filepath.Join(wd, "tpm") || got[5] != "type=unixio,path="+filepath.Join(wd, "c.sock") ||
		got[7] != "file="+filepath.Join(wd, "l.log")+",level=1" {
		t.Errorf("relative paths not made absolute: %q", got)
	}
	if c := (Config{StateDir: "/s"}).WithDefaults(); c.Binary != DefaultBinary {
		t.Errorf("default binary %q", c.Binary)
	}
	if p := PrevLogFile("/s/swtpm.log"); p != "/s/swtpm.prev.log" {
		t.Errorf("PrevLogFile %q", p)
	}
}

func TestStartProbeTerminate(t *testing.T) {
	needSwtpm(t)
	dir := shortDir(t)
	cfg := Config{StateDir: filepath.Join(dir, "tpm")}.WithDefaults()
	if err := os.MkdirAll(cfg.StateDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg.LogFile, []byte("previous run\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A stale socket left by a killed swtpm.
	l, err := net.Listen("unix", cfg.CtrlSocket)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()

	t0 := time.Now()
	p, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("start to control channel answering: %v", time.Since(t0))
	defer p.Terminate(StopGrace)

	if fi, err := os.Stat(cfg.StateDir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("state dir mode %v (%v), want 0700", fi.Mode().Perm(), err)
	}
	if b, err := os.ReadFile(PrevLogFile(cfg.LogFile)); err != nil || string(b) != "previous run\n" {
		t.Errorf("previous log not kept: %q %v", b, err)
	}
	if b, _ := os.ReadFile(cfg.LogFile); strings.Contains(string(b), "previous run") {
		t.Error("the new log still holds the previous run")
	}
	// The probe connection of Start must not have ended swtpm (--terminate
	// is about the data channel).
	if err := Probe(ctxT(t, 5*time.Second), cfg.CtrlSocket); err != nil {
		t.Fatalf("second probe: %v", err)
	}
	if p.Exited() {
		t.Fatal("swtpm exited after probes")
	}

	t1 := time.Now()
	p.Terminate(StopGrace)
	t.Logf("terminate: %v", time.Since(t1))
	if !p.Exited() {
		t.Fatal("still running after Terminate")
	}
	err = Probe(ctxT(t, 300*time.Millisecond), cfg.CtrlSocket)
	if !errors.Is(err, ErrUnresponsive) {
		t.Errorf("probe after Terminate: %v, want ErrUnresponsive", err)
	}
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestStartBogusBinary(t *testing.T) {
	dir := shortDir(t)
	_, err := Start(context.Background(), Config{Binary: filepath.Join(dir, "no-such-swtpm"), StateDir: filepath.Join(dir, "tpm")})
	if err == nil {
		t.Fatal("started a missing binary")
	}
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("err %v, want one wrapping ErrNotExist", err)
	}
}

func TestStartBinaryThatExitsFailsFast(t *testing.T) {
	dir := shortDir(t)
	// Not plain "false": a process that is a zombie before proc.Start reads
	// its start time fails proc.Start itself.
	fake := filepath.Join(dir, "fake-swtpm")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\nsleep 0.2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	_, err := Start(context.Background(), Config{Binary: fake, StateDir: filepath.Join(dir, "tpm")})
	if !errors.Is(err, ErrUnresponsive) || !strings.Contains(err.Error(), "exited with code 1") {
		t.Fatalf("err %v", err)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Errorf("took %v: an exited swtpm must not wait for the probe timeout", d)
	}
}

func TestStartUnresponsive(t *testing.T) {
	dir := shortDir(t)
	// Takes swtpm's arguments, never opens the control socket.
	fake := filepath.Join(dir, "fake-swtpm")
	pidFile := filepath.Join(dir, "pid")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\necho $$ > "+pidFile+"\necho fake swtpm starting >&2\nexec sleep 30\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := Config{Binary: fake, StateDir: filepath.Join(dir, "tpm")}.WithDefaults()
	t0 := time.Now()
	p, err := Start(context.Background(), cfg)
	d := time.Since(t0)
	if p != nil || !errors.Is(err, ErrUnresponsive) {
		t.Fatalf("Start = %v, %v; want ErrUnresponsive", p, err)
	}
	if !strings.Contains(err.Error(), "vtpm not responding") || !strings.Contains(err.Error(), "fake swtpm starting") {
		t.Errorf("error lacks the reason or the log tail: %v", err)
	}
	if d < ProbeTimeout-100*time.Millisecond || d > ProbeTimeout+3*time.Second {
		t.Errorf("gave up after %v, want about %v", d, ProbeTimeout)
	}
	t.Logf("unresponsive start failed after %v", d)
	// Terminated and reaped: not even a zombie is left.
	pid, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat("/proc/" + strings.TrimSpace(string(pid))); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("fake swtpm (pid %s) still exists: %v", strings.TrimSpace(string(pid)), err)
	}
}

func TestStartHonoursContext(t *testing.T) {
	dir := shortDir(t)
	fake := filepath.Join(dir, "fake-swtpm")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\nexec sleep 30\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	_, err := Start(ctxT(t, 300*time.Millisecond), Config{Binary: fake, StateDir: filepath.Join(dir, "tpm")})
	if !errors.Is(err, ErrUnresponsive) || time.Since(t0) > 3*time.Second {
		t.Fatalf("err %v after %v", err, time.Since(t0))
	}
}

func TestStartRejectsBadConfig(t *testing.T) {
	for name, cfg := range map[string]Config{
		"no state dir": {},
		"long socket":  {StateDir: "/tmp/" + strings.Repeat("x", 100)},
		"comma":        {StateDir: "/tmp/a,b"},
	} {
		if _, err := Start(context.Background(), cfg); apierr.CodeOf(err) != apierr.InvalidRequest {
			t.Errorf("%s: %v, want invalid_request", name, err)
		}
	}
}

func TestProbeAnswer(t *testing.T) {
	dir := shortDir(t)
	sock := filepath.Join(dir, "ctrl.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	answers := [][]byte{
		{0, 0, 0, 9, 0, 0, 0, 0}, // TPM error result
		{0, 0, 0},                // short answer, then close
		{0, 0, 0, 0, 0, 0, 0x7f, 0xff},
	}
	go func() {
		for _, a := range answers {
			c, err := l.Accept()
			if err != nil {
				return
			}
			var cmd [4]byte
			if _, err := c.Read(cmd[:]); err != nil || cmd != [4]byte{0, 0, 0, 1} {
				t.Errorf("command %v (%v), want CMD_GET_CAPABILITY", cmd, err)
			}
			c.Write(a)
			c.Close()
		}
	}()
	// The first two answers are rejected and retried; the third succeeds.
	if err := Probe(ctxT(t, 5*time.Second), sock); err != nil {
		t.Fatal(err)
	}
}
