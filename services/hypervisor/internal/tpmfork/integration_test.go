package tpmfork

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"github.com/google/go-tpm/tpm2"
)

const (
	qemuBinary = "qemu-system-x86_64"
	ovmfCode   = "/usr/share/OVMF/OVMF_CODE_4M.fd"
	ovmfVars   = "/usr/share/OVMF/OVMF_VARS_4M.fd"
	guestMiB   = 512
)

// TestForkGetsItsOwnTPM boots the test guest (parent), saves it with
// migrate, and restores it into a new QEMU and a fresh swtpm behind a Proxy
// with blobs from Prepare. The fork must keep running, hold its own EK and AK
// and the parent's values in the replayed PCRs.
func TestForkGetsItsOwnTPM(t *testing.T) {
	prefix := testGuest(t)
	_, err := exec.LookPath(qemuBinary)
	need(t, qemuBinary, err == nil)
	_, err = exec.LookPath(swtpm.DefaultBinary)
	need(t, swtpm.DefaultBinary, err == nil)
	need(t, ovmfCode, fileExists(ovmfCode) && fileExists(ovmfVars))
	ctx := context.Background()

	// Short paths: unix sockets allow 107 bytes.
	dir, err := os.MkdirTemp("", "tpmfork-")
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv("TPMFORK_KEEP") == "" {
		t.Cleanup(func() { os.RemoveAll(dir) })
	} else {
		t.Logf("keeping %s", dir)
	}
	p := func(name string) string { return filepath.Join(dir, name) }
	copyFile(t, prefix+".vmlinuz", p("vmlinuz"))
	copyFile(t, prefix+".initrd", p("initrd"))
	copyFile(t, ovmfVars, p("parent-vars.fd"))
	cmdline := "console=ttyS0 panic=-1"
	if b, err := os.ReadFile(prefix + ".cmdline"); err == nil {
		cmdline = strings.TrimSpace(string(b))
	}
	ca, err := swtpm.LoadCA(p("ca"), "tpmfork test CA")
	if err != nil {
		t.Fatal(err)
	}

	// The parent, provisioned as the hypervisor does before every launch.
	pcfg := swtpm.Config{StateDir: p("parent-tpm"), Linger: true}.WithDefaults()
	if _, err := swtpm.Provision(ctx, pcfg, ca, "parent"); err != nil {
		t.Fatal(err)
	}
	ptpm, err := swtpm.Start(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ptpm.Terminate(swtpm.StopGrace) })
	v, err := qemu.ProbeVersion(ctx, qemuBinary)
	if err != nil {
		t.Fatal(err)
	}
	spec := qemu.Spec{
		ID: "tpmfork-test", QEMUVersion: v, Accel: qemu.AccelTCG, CPUs: 1, MemoryMiB: guestMiB,
		ConsoleLog: p("parent-console.log"), QMPSocket: p("parent-qmp.sock"),
		OVMFCode: ovmfCode, OVMFVars: p("parent-vars.fd"),
		Boot: qemu.BootKernel, Kernel: p("vmlinuz"), Initrd: p("initrd"), Cmdline: cmdline,
		SwtpmSocket: pcfg.CtrlSocket,
	}
	t0 := time.Now()
	parent := startQEMU(t, spec, p("parent-qemu.log"))
	waitConsole(t, spec.ConsoleLog, "ready (", 180*time.Second, parent)
	t.Logf("parent: start to ready %v", time.Since(t0))

	// The firmware's event log, from guest RAM (see eventlog_test.go).
	rawQMP(t, spec.QMPSocket, fmt.Sprintf(`{"execute":"pmemsave","arguments":{"val":0,"size":%d,"filename":%q}}`, guestMiB<<20, p("ram")))
	ram, err := os.ReadFile(p("ram"))
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(p("ram"))
	evs := findEventLogs(ram)
	ram = nil
	if len(evs) == 0 {
		t.Fatal("no TCG2 event log in the parent's RAM")
	}

	// Save: stop, migrate to a file, quit.
	m := connect(t, spec.QMPSocket)
	t1 := time.Now()
	must(t, m.Stop(ctxT(t, 10*time.Second)))
	must(t, m.SetMaxBandwidth(ctxT(t, 10*time.Second), 10<<30))
	must(t, m.Migrate(ctxT(t, 60*time.Second), "exec:cat > "+p("state")))
	save := time.Since(t1)
	// SIGKILL: an orderly exit sends CMD_SHUTDOWN, which ends swtpm.
	must(t, parent.Signal(syscall.SIGKILL))
	waitExit(t, parent, 30*time.Second)
	fi, _ := os.Stat(p("state"))
	t.Logf("parent: save %v, %d bytes", save, fi.Size())
	parentTPM := readTPM(t, pcfg.CtrlSocket)
	ptpm.Terminate(swtpm.StopGrace)

	// The parent's verified measurements: the PCRs whose log replays to
	// the values the parent's TPM holds.
	replayed := map[uint32]bool{}
	var mismatched []uint32
	for pcr, val := range replayLog(evs) {
		if bytes.Equal(val, parentTPM.pcrs[pcr]) {
			replayed[pcr] = true
		} else {
			mismatched = append(mismatched, pcr)
		}
	}
	slices.Sort(mismatched)
	t.Logf("event log: %d events; replays to the parent's pcrs %v, not to %v", len(evs), sortedKeys(replayed), mismatched)
	for pcr := range uint32(8) {
		if !replayed[pcr] {
			t.Errorf("firmware pcr %d does not replay from the log", pcr)
		}
	}
	t.Logf("parent: TPM_PT_STARTUP_CLEAR %#x (phEnable %v), empty platform password works: %v", parentTPM.startupClear, parentTPM.startupClear&1 != 0, parentTPM.platformAuthEmpty)

	// The fork's state, made on a host swtpm.
	replay := extendsFor(evs, replayed)
	t2 := time.Now()
	opt := Options{Platform: PlatformRandomAuth}
	switch {
	case parentTPM.startupClear&1 == 0:
		opt.Platform = PlatformDisabled
	case parentTPM.platformAuthEmpty:
		opt.Platform = PlatformOpen
	}
	prep, err := Prepare(ctx, swtpm.Config{StateDir: p("prep")}, ca, "fork", replay, opt)
	if err != nil {
		t.Fatal(err)
	}
	for pcr := range replayed {
		if !bytes.Equal(prep.PCRs[pcr], parentTPM.pcrs[pcr]) {
			t.Errorf("Prepare left pcr %d at %x, the parent has %x", pcr, prep.PCRs[pcr], parentTPM.pcrs[pcr])
		}
	}
	t.Logf("Prepare: %v for %d extends; blobs permanent %d, volatile %d, savestate %d bytes",
		time.Since(t2), len(replay), len(prep.Permanent), len(prep.Volatile), len(prep.SaveState))

	// Restore into a fresh swtpm behind the proxy.
	fcfg := swtpm.Config{StateDir: p("fork-tpm"), Linger: true}.WithDefaults()
	startTracedSwtpm(t, fcfg)
	proxy, err := Listen(p("fork-ctrl.sock"), fcfg.CtrlSocket, prep.Blobs, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	copyFile(t, p("parent-vars.fd"), p("fork-vars.fd"))
	fspec := spec
	fspec.ConsoleLog, fspec.QMPSocket, fspec.OVMFVars, fspec.SwtpmSocket = p("fork-console.log"), p("fork-qmp.sock"), p("fork-vars.fd"), p("fork-ctrl.sock")
	t3 := time.Now()
	// -no-shutdown: the guest's power-off pauses QEMU; SIGKILL then leaves
	// the fork's swtpm running for the host to read.
	fork := startQEMU(t, fspec, p("fork-qemu.log"), "-incoming", "defer", "-no-shutdown")
	fm := connect(t, fspec.QMPSocket)
	nStart := len(proxy.Messages())
	must(t, fm.MigrateIncoming(ctxT(t, 60*time.Second), "exec:cat "+p("state")))
	loaded := time.Since(t3)
	if err := proxy.Check(); err != nil {
		t.Fatalf("proxy: %v; refusing to cont", err)
	}
	traceFrom := fileSize(fcfg.LogFile)
	must(t, fm.Cont(ctxT(t, 10*time.Second)))
	t.Logf("fork: QEMU start to migrate-incoming done %v, to cont %v", loaded, time.Since(t3))
	msgs := proxy.Messages()
	t.Logf("control channel at QEMU start: %s", describe(msgs[:nStart]))
	t.Logf("control channel on incoming migration: %s", describe(msgs[nStart:]))
	for _, s := range proxy.Substitutions() {
		t.Logf("substituted %v: parent %d bytes (flags %#x) -> fork %d bytes, result %#x", s.Type, s.ParentLen, s.ParentFlags, s.ForkLen, s.Result)
	}

	// The guest runs on: the power button reaches vm-agent, which prints
	// and powers off (the kernel sends TPM2_Shutdown to the fork's TPM).
	if st, err := fm.Status(ctxT(t, 10*time.Second)); err != nil || st != "running" {
		t.Fatalf("fork status %q, %v", st, err)
	}
	must(t, fm.Powerdown(ctxT(t, 10*time.Second)))
	waitConsole(t, fspec.ConsoleLog, "power button, powering off", 60*time.Second, fork)
	poll.UntilWithin(t, 60*time.Second, "the fork's shutdown after the power button", func() bool {
		st, err := fm.Status(ctxT(t, 10*time.Second))
		must(t, err)
		return st == "shutdown"
	})
	must(t, fork.Signal(syscall.SIGKILL))
	waitExit(t, fork, 30*time.Second)
	console, _ := os.ReadFile(fspec.ConsoleLog)
	t.Logf("fork console after restore:\n%s", console)
	for _, l := range strings.Split(string(console), "\n") {
		if strings.Contains(strings.ToLower(l), "tpm") {
			t.Errorf("the guest complained about its TPM: %s", l)
		}
	}
	proxy.Close()
	t.Logf("control channel after cont: %s", describe(proxy.Messages()[len(msgs):]))

	// What the guest sent the fork's TPM after cont, and its answers.
	trace := guestCommands(t, fcfg.LogFile, traceFrom)
	t.Logf("guest TPM commands on the fork's TPM after cont (code -> rc): %v", trace)
	if len(trace) == 0 || trace[len(trace)-1] != [2]uint32{0x145, 0} {
		t.Errorf("the guest's TPM2_Shutdown did not succeed on the fork's TPM: %v", trace)
	}
	forkTPM := readTPM(t, fcfg.CtrlSocket)
	switch {
	case !bytes.Equal(forkTPM.ek.Public, prep.Identity.EK.Public) || !bytes.Equal(forkTPM.ak.Public, prep.Identity.AK.Public):
		t.Error("the fork's TPM does not hold the EK and AK Prepare made")
	case bytes.Equal(forkTPM.ek.Public, parentTPM.ek.Public):
		t.Error("the fork has the parent's EK")
	case bytes.Equal(forkTPM.ak.Public, parentTPM.ak.Public):
		t.Error("the fork has the parent's AK")
	}
	t.Logf("EK parent %s fork %s; AK parent %s fork %s",
		vtpm.Fingerprint(parentTPM.ek.Public)[:16], vtpm.Fingerprint(forkTPM.ek.Public)[:16],
		vtpm.Fingerprint(parentTPM.ak.Public)[:16], vtpm.Fingerprint(forkTPM.ak.Public)[:16])
	for pcr := range uint32(24) {
		same := bytes.Equal(forkTPM.pcrs[pcr], parentTPM.pcrs[pcr])
		if replayed[pcr] && !same {
			t.Errorf("pcr %d: fork %x, parent %x", pcr, forkTPM.pcrs[pcr], parentTPM.pcrs[pcr])
		}
		if !same {
			t.Logf("pcr %d (not replayed) differs: fork %x, parent %x", pcr, forkTPM.pcrs[pcr], parentTPM.pcrs[pcr])
		}
	}
	t.Logf("platform auth empty: parent %v, fork %v", parentTPM.platformAuthEmpty, forkTPM.platformAuthEmpty)
	if forkTPM.platformAuthEmpty != parentTPM.platformAuthEmpty {
		t.Error("the fork's platform password is not as the parent's firmware left it")
	}
	if forkTPM.startupClear&1 != parentTPM.startupClear&1 {
		t.Errorf("phEnable: fork %v, parent %v", forkTPM.startupClear&1 != 0, parentTPM.startupClear&1 != 0)
	}
}

// tpmState is what the host reads from an swtpm after its QEMU ended.
type tpmState struct {
	pcrs         map[uint32][]byte // sha256
	ek, ak       *vtpm.Key
	startupClear uint32 // TPMA_STARTUP_CLEAR
	// platformAuthEmpty: the EK certificate reads with the empty platform
	// password (firmware may have set a random one).
	platformAuthEmpty bool
}

func readTPM(t *testing.T, ctrl string) tpmState {
	t.Helper()
	// One data channel for everything: swtpm serves one at a time.
	tc, err := swtpm.DataChannel(ctxT(t, 20*time.Second), ctrl)
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	st := tpmState{pcrs: map[uint32][]byte{}}
	for start := uint(0); start < 24; start += 8 {
		idx := []uint{start, start + 1, start + 2, start + 3, start + 4, start + 5, start + 6, start + 7}
		sel := tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(idx...)}}}
		rsp, err := (tpm2.PCRRead{PCRSelectionIn: sel}).Execute(tc)
		if err != nil || len(rsp.PCRValues.Digests) != 8 {
			t.Fatalf("TPM2_PCR_Read %d..: %v (%d digests)", start, err, len(rsp.PCRValues.Digests))
		}
		for i, d := range rsp.PCRValues.Digests {
			st.pcrs[uint32(start)+uint32(i)] = d.Buffer
		}
	}
	if st.ek, err = vtpm.ReadKey(tc, vtpm.EKHandle); err != nil {
		t.Fatalf("EK: %v", err)
	}
	if st.ak, err = vtpm.ReadKey(tc, vtpm.AKHandle); err != nil {
		t.Fatalf("AK: %v", err)
	}
	cap, err := tpm2.GetCapability{Capability: tpm2.TPMCapTPMProperties, Property: uint32(tpm2.TPMPTStartupClear), PropertyCount: 1}.Execute(tc)
	if err != nil {
		t.Fatal(err)
	}
	props, err := cap.CapabilityData.Data.TPMProperties()
	if err != nil || len(props.TPMProperty) != 1 {
		t.Fatalf("TPM_PT_STARTUP_CLEAR: %v", err)
	}
	st.startupClear = props.TPMProperty[0].Value
	nv, err := tpm2.NVReadPublic{NVIndex: vtpm.EKCertIndex}.Execute(tc)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tpm2.NVRead{
		AuthHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHPlatform, Auth: tpm2.PasswordAuth(nil)},
		NVIndex:    tpm2.NamedHandle{Handle: vtpm.EKCertIndex, Name: nv.NVName}, Size: 1,
	}.Execute(tc)
	st.platformAuthEmpty = err == nil
	return st
}

func describe(msgs []Message) string {
	var b strings.Builder
	for _, m := range msgs {
		if m.Cmd == CmdSetStateBlob {
			fmt.Fprintf(&b, " SET_STATEBLOB(%v,%d)", m.Type, m.Len-12)
		} else {
			fmt.Fprintf(&b, " %#x", m.Cmd)
			if m.FDs > 0 {
				fmt.Fprintf(&b, "+%dfd", m.FDs)
			}
		}
	}
	return strings.TrimSpace(b.String())
}

// testGuest is VMM_TEST_GUEST or the repository's built test guest.
func testGuest(t *testing.T) string {
	if p := os.Getenv("VMM_TEST_GUEST"); p != "" {
		return p
	}
	wd, _ := os.Getwd()
	for d := wd; d != "/"; d = filepath.Dir(d) {
		if fileExists(filepath.Join(d, "go.work")) {
			m, _ := filepath.Glob(filepath.Join(d, ".run/state/images/test-guest_*.vmlinuz"))
			if len(m) > 0 {
				return strings.TrimSuffix(m[len(m)-1], ".vmlinuz")
			}
		}
	}
	need(t, "the test guest (VMM_TEST_GUEST, or make guest-image)", false)
	return ""
}

func startQEMU(t *testing.T, s qemu.Spec, logPath string, extra ...string) *proc.Process {
	t.Helper()
	args, err := s.Args()
	if err != nil {
		t.Fatal(err)
	}
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(qemuBinary, append(args, extra...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	pr, err := proc.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pr.Terminate(5 * time.Second)
		if b, _ := os.ReadFile(logPath); len(b) > 0 {
			t.Logf("%s:\n%s", filepath.Base(logPath), b)
		}
	})
	return pr
}

func connect(t *testing.T, sock string) *qemu.Monitor {
	t.Helper()
	m, err := qemu.Connect(ctxT(t, 10*time.Second), sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// rawQMP runs one command on a connection of its own (qemu.Monitor has no
// pmemsave).
func rawQMP(t *testing.T, sock, cmd string) {
	t.Helper()
	mon, err := qmp.NewSocketMonitor("unix", sock, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := mon.Connect(); err != nil {
		t.Fatal(err)
	}
	defer mon.Disconnect()
	if out, err := mon.Run([]byte(cmd)); err != nil {
		t.Fatalf("%s: %v (%s)", cmd, err, out)
	}
}

func waitConsole(t *testing.T, path, want string, d time.Duration, pr *proc.Process) {
	t.Helper()
	poll.UntilWithin(t, d, fmt.Sprintf("%q on the console", want), func() bool {
		b, _ := os.ReadFile(path)
		if bytes.Contains(b, []byte(want)) {
			return true
		}
		if pr.Exited() {
			t.Fatalf("no %q on the console and QEMU exited; console:\n%s", want, b)
		}
		return false
	})
}

func waitExit(t *testing.T, pr *proc.Process, d time.Duration) {
	t.Helper()
	select {
	case <-pr.Done():
	case <-time.After(d):
		t.Fatalf("process %d still runs after %v", pr.PID, d)
	}
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	must(t, out.Close())
}

func sortedKeys(m map[uint32]bool) []uint32 {
	out := make([]uint32, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
