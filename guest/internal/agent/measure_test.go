package agent

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-tpm/tpm2"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/pcrextend"
	"github.com/giantswarm/vm-manager/guest/internal/swtpmtest"
	"github.com/giantswarm/vm-manager/guest/internal/sysext"
	"github.com/giantswarm/vm-manager/pkg/measure"
)

// recordingExtender is the real extender, with each extend noted in the
// fake IMDS's event list so the order against requests shows.
type recordingExtender struct {
	f   *fakeIMDS
	ext *pcrextend.Extender
}

func (r *recordingExtender) Extend(pcr uint32, word, typ string) ([]string, error) {
	r.f.log("extend " + word)
	return r.ext.Extend(pcr, word, typ)
}

func pcr11(t *testing.T, sock string) []byte {
	t.Helper()
	tpm, err := attest.OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close()
	v, err := attest.ReadPCRs(tpm, tpm2.TPMAlgSHA256, []uint{11})
	if err != nil {
		t.Fatal(err)
	}
	return v[11]
}

// The phase words go in at the briefed points, and after the ready path PCR
// 11 is what pkg/measure replays from the log this boot wrote.
func TestPhasesOnTheReadyPath(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	f := &fakeIMDS{userData: userData}
	fx := newFixture(t, f)
	logPath := filepath.Join(t.TempDir(), "tpm2-measure.log")
	fx.p.phases = &phases{con: fx.p.con, ext: &recordingExtender{f: f, ext: &pcrextend.Extender{TPMPath: sw.Socket(), LogPath: logPath}}}
	var atInitrd, atReady []byte
	fx.p.attest = func(ctx context.Context, stage string) attestResult {
		if stage == attest.StageInitrd {
			atInitrd = pcr11(t, sw.Socket())
		} else {
			atReady = pcr11(t, sw.Socket())
		}
		return f.attest(ctx, stage)
	}
	fx.p.sysext = func(context.Context) sysext.Result {
		f.log("sysext")
		return sysext.Result{Version: "1.31.1", State: sysext.StateMerged}
	}
	res := fx.p.run(context.Background())
	if res.sysext.State != sysext.StateMerged {
		t.Errorf("results %+v", res)
	}
	want := "extend enter-initrd, GET /hostname, GET /public-keys/, GET /public-keys/0, GET /public-keys/1, attest initrd, GET /user-data, " +
		"extend leave-initrd, extend sysinit, sysext, extend ready, attest ready"
	if got := strings.Join(f.events, ", "); got != want {
		t.Errorf("order:\n got %s\nwant %s", got, want)
	}
	b, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	evs, err := measure.ParseLog(b)
	if err != nil {
		t.Fatal(err)
	}
	initrd, _ := measure.PCR11(nil, measure.PhaseInitrd)
	ready, _ := measure.PCR11(nil, measure.PhaseReady)
	if final := pcr11(t, sw.Socket()); !bytes.Equal(final, measure.Replay(evs)) || !bytes.Equal(final, ready) || !bytes.Equal(atReady, ready) {
		t.Errorf("PCR 11 %x (at the ready quote %x), log replays to %x, phase path %x", final, atReady, measure.Replay(evs), ready)
	}
	if !bytes.Equal(atInitrd, initrd) {
		t.Errorf("PCR 11 at the initrd quote %x, want %x", atInitrd, initrd)
	}
	if !strings.Contains(fx.out.String(), `vm-agent: boot phase "ready" extended into PCR 11 (`) {
		t.Errorf("console:\n%s", fx.out)
	}
}

// A direct-kernel boot (no stub) extends nothing, with or without an IMDS.
func TestNoStubNoPhases(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	fx := newFixture(t, &fakeIMDS{})
	fx.p.phases = &phases{con: fx.p.con}
	fx.p.run(context.Background())
	offlinePhases(fx.p.phases)
	offlinePhases(nil)
	if v := pcr11(t, sw.Socket()); !bytes.Equal(v, measure.Zero()) {
		t.Errorf("PCR 11 %x", v)
	}
}

// Without an IMDS the phase path still reaches ready.
func TestOfflinePhases(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	var out bytes.Buffer
	logPath := filepath.Join(t.TempDir(), "log")
	offlinePhases(&phases{con: NewConsole(&out), ext: &pcrextend.Extender{TPMPath: sw.Socket(), LogPath: logPath}})
	b, _ := os.ReadFile(logPath)
	evs, err := measure.ParseLog(b)
	ready, _ := measure.PCR11(nil, measure.PhaseReady)
	if err != nil || len(evs) != 4 || !bytes.Equal(pcr11(t, sw.Socket()), ready) {
		t.Errorf("%d events, %v; console:\n%s", len(evs), err, out.String())
	}
}
