package pcrextend

import (
	"bytes"
	"crypto/sha1"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-tpm/tpm2"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/swtpmtest"
	"github.com/giantswarm/vm-manager/pkg/measure"
)

func readPCR(t *testing.T, sock string, bank tpm2.TPMAlgID, pcr uint) []byte {
	t.Helper()
	tpm, err := attest.OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close()
	v, err := attest.ReadPCRs(tpm, bank, []uint{pcr})
	if err != nil {
		t.Fatal(err)
	}
	return v[pcr]
}

// The ready path's four words go into PCR 11 of every bank swtpm allocated,
// and the log written beside them replays to the sha256 value.
func TestPhasesReplayToPCR11(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	logPath := filepath.Join(t.TempDir(), "run/log/systemd/tpm2-measure.log")
	usec := uint64(1000)
	e := &Extender{TPMPath: sw.Socket(), LogPath: logPath, BootID: "0123456789abcdef0123456789abcdef",
		Now: func() uint64 { usec += 250; return usec }}
	var banks []string
	for _, w := range measure.PhaseWords(measure.PhaseReady) {
		var err error
		if banks, err = e.Extend(measure.PCRKernelImage, w, measure.EventTypePhase); err != nil {
			t.Fatal(err)
		}
		// swtpm 0.7 without swtpm_setup allocates sha1, sha256, sha384 and sha512.
		if !slices.Contains(banks, "sha1") || !slices.Contains(banks, "sha256") {
			t.Fatalf("banks %v", banks)
		}
	}
	b, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	evs, err := measure.ParseLog(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 4 {
		t.Fatalf("%d events", len(evs))
	}
	got := readPCR(t, sw.Socket(), tpm2.TPMAlgSHA256, 11)
	if !bytes.Equal(got, measure.Replay(evs)) {
		t.Errorf("PCR 11 %x, log replays to %x", got, measure.Replay(evs))
	}
	// The same as a UKI without sections would give: the phase words alone.
	want, _ := measure.PCR11(nil, measure.PhaseReady)
	if !bytes.Equal(got, want) {
		t.Errorf("PCR 11 %x, measure.PCR11 %x", got, want)
	}
	// The sha1 bank got its own hash of each word.
	pcr1 := make([]byte, sha1.Size)
	for _, w := range measure.PhaseWords(measure.PhaseReady) {
		d := sha1.Sum([]byte(w))
		h := sha1.Sum(append(pcr1, d[:]...))
		pcr1 = h[:]
	}
	if got := readPCR(t, sw.Socket(), tpm2.TPMAlgSHA1, 11); !bytes.Equal(got, pcr1) {
		t.Errorf("sha1 PCR 11 %x, want %x", got, pcr1)
	}

	// Records as systemd writes them: RS-separated JSON, every bank, context.
	entries := bytes.Split(bytes.TrimSuffix(bytes.TrimPrefix(b, []byte{0x1e}), []byte("\n")), []byte("\n\x1e"))
	if len(entries) != 4 {
		t.Fatalf("%d entries in %q", len(entries), b)
	}
	var r measure.Record
	if err := json.Unmarshal(entries[3], &r); err != nil {
		t.Fatal(err)
	}
	d1 := sha1.Sum([]byte("ready"))
	if r.PCR != 11 || r.Content.String != "ready" || r.Content.EventType != "phase" || r.Content.BootID != e.BootID ||
		r.Content.Timestamp != 2000 || len(r.Digests) != len(banks) ||
		!slices.Contains(r.Digests, measure.RecordDigest{HashAlg: "sha1", Digest: hex.EncodeToString(d1[:])}) ||
		!slices.Contains(r.Digests, measure.RecordDigest{HashAlg: "sha256", Digest: hex.EncodeToString(measure.Digest([]byte("ready")))}) {
		t.Errorf("record %+v", r)
	}
	if st, _ := os.Stat(logPath); st.Mode().Perm() != 0o600 {
		t.Errorf("log mode %v", st.Mode())
	}
}

// Without a TPM nothing is logged: the log must replay to what the TPM holds.
func TestExtendWithoutTPMLogsNothing(t *testing.T) {
	dir := t.TempDir()
	e := &Extender{TPMPath: filepath.Join(dir, "no-tpm"), LogPath: filepath.Join(dir, "log")}
	if _, err := e.Extend(11, "enter-initrd", measure.EventTypePhase); err == nil || !strings.Contains(err.Error(), "opening the TPM") {
		t.Fatalf("err %v", err)
	}
	if _, err := os.Stat(e.LogPath); !os.IsNotExist(err) {
		t.Errorf("log written: %v", err)
	}
}

func TestStubBootedAndBootID(t *testing.T) {
	dir := t.TempDir()
	if StubBooted(dir) {
		t.Error("stub seen in an empty efivarfs")
	}
	os.WriteFile(filepath.Join(dir, StubVariable), []byte{6, 0, 0, 0, '1', 0, '1', 0, 0, 0}, 0o644)
	if !StubBooted(dir) {
		t.Error("stub variable not seen")
	}
	p := filepath.Join(dir, "boot_id")
	os.WriteFile(p, []byte("6f1b3c52-9a0e-4b7d-8c1f-2a3b4c5d6e7f\n"), 0o444)
	if id := BootID(p); id != "6f1b3c529a0e4b7d8c1f2a3b4c5d6e7f" {
		t.Errorf("boot id %q", id)
	}
	if MonotonicUsec() == 0 {
		t.Error("no monotonic clock")
	}
}
