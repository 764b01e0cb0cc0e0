package verify

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-tpm/legacy/tpm2"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
)

// The fixture's UKI: systemd-stub measures these sections into PCR 11 and
// logs each as two EV_IPL events described by the section's name in UTF-16.
var ukiSections = []struct{ name, content string }{
	{".linux", "vmlinuz"}, {".osrel", "ID=test-guest\n"}, {".cmdline", "console=ttyS0 panic=-1"}, {".initrd", "initrd.cpio"},
}

func ukiEvents() []testEvent {
	var evs []testEvent
	for _, s := range ukiSections {
		evs = append(evs,
			testEvent{pcr: 11, typ: evIPL, data: ucs2(s.name, true), meas: append([]byte(s.name), 0)},
			testEvent{pcr: 11, typ: evIPL, data: ucs2(s.name, true), meas: []byte(s.content)})
	}
	return evs
}

// ukiSectionDigests are the sections as a policy's uki.sections has them.
func ukiSectionDigests() map[string][]byte {
	m := map[string][]byte{}
	for _, s := range ukiSections {
		m[s.name] = measure.Digest([]byte(s.content))
	}
	return m
}

const fixtureKubernetes = "1.35.0"

func fixtureSysextLine() string {
	return measure.SysextLine(hex.EncodeToString(measure.Digest([]byte("kubernetes sysext"))), measure.SysextFile(fixtureKubernetes))
}

type word struct {
	pcr       uint32
	word, typ string
}

// fixtureWords are vm-agent's extends after the firmware's: the initrd
// phase into PCR 11, the Kubernetes sysext into PCR 13.
func fixtureWords() []word {
	return []word{
		{11, measure.WordEnterInitrd, measure.EventTypePhase},
		{13, measure.WordOSSeparator, measure.EventTypeOSSeparator},
		{13, fixtureSysextLine(), measure.EventTypeSysext},
	}
}

// userLog writes words as vm-agent's tpm2-measure.log, without the boot ID
// and timestamp (which nothing replays) to keep fuzz seeds small.
func userLog(words ...word) []byte {
	var b bytes.Buffer
	for _, w := range words {
		if err := measure.WriteRecord(&b, measure.WordRecord(w.pcr, w.word, w.typ, "", 0)); err != nil {
			panic(err)
		}
	}
	return b.Bytes()
}

func ofPCRs(evs []Event, pcrs ...uint32) []Event {
	var out []Event
	for _, e := range evs {
		if slices.Contains(pcrs, e.PCR) {
			out = append(out, e)
		}
	}
	return out
}

func digestsOf[E Event | measure.Event](evs []E) []string {
	var out []string
	for _, e := range evs {
		switch e := any(e).(type) {
		case Event:
			out = append(out, hex.EncodeToString(e.Digest))
		case measure.Event:
			out = append(out, hex.EncodeToString(e.Digest))
		}
	}
	return out
}

// A UKI boot: PCR 11 is the firmware log's section events, then the
// userspace log's phase word; PCR 13 the userspace log's alone.
func TestUKIQuoteReplaysBothLogs(t *testing.T) {
	f := getFixture(t)
	for _, stage := range []struct {
		name  string
		pcrs  []int
		stage attestationv1.Stage
	}{{"initrd", initrdPCRs, initrd}, {"ready", readyPCRs, ready}} {
		t.Run(stage.name, func(t *testing.T) {
			nonce := newNonce(t)
			q := f.quote(t, f.ecc, tpm2.AlgSHA256, stage.pcrs, nonce)
			q.Stage, q.EventLog, q.UserspaceLog = stage.stage, f.ukiLog, f.userLog
			res := mustVerify(t, q, nonce)
			if res.EventLogError != "" {
				t.Fatalf("EventLogError = %q", res.EventLogError)
			}
			checkEventsReplay(t, res.Events, res.PCRs)
			// The firmware PCRs are as the firmware log alone has them.
			if want := ofPCRs(mustReplay(t, f.log, res.PCRs), 0, 1, 2, 3, 4, 5, 6, 7); !slices.EqualFunc(ofPCRs(res.Events, 0, 1, 2, 3, 4, 5, 6, 7), want, eventEqual) {
				t.Errorf("firmware events differ from the firmware log's own replay")
			}

			// PCR 11 is exactly what pkg/measure says a UKI boot's is.
			p11 := ofPCRs(res.Events, 11)
			want, err := measure.PCR11Events(ukiSectionDigests(), measure.PhaseInitrd)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(digestsOf(p11), digestsOf(want)) {
				t.Fatalf("pcr 11 events %v, want %v", digestsOf(p11), digestsOf(want))
			}
			for i, e := range p11[:len(p11)-1] {
				if name := ukiSections[i/2].name; e.Type != "EV_IPL" || e.Description != name {
					t.Errorf("pcr 11 event %d = %s %q, want EV_IPL %q", i, e.Type, e.Description, name)
				}
			}
			if last := p11[len(p11)-1]; last.Type != TypeUserspace || last.Description != `phase "enter-initrd"` {
				t.Errorf("last pcr 11 event = %s %q", last.Type, last.Description)
			}

			// PCR 13 only where it is quoted.
			p13 := ofPCRs(res.Events, 13)
			if stage.stage == initrd {
				if len(p13) != 0 {
					t.Errorf("pcr 13 is not quoted at initrd, yet has events %v", p13)
				}
				return
			}
			if !slices.Equal(digestsOf(p13), digestsOf(measure.PCR13Events(fixtureSysextLine()))) ||
				p13[0].Description != `os-separator "os-separator"` || p13[1].Description != fmt.Sprintf("sysext %q", fixtureSysextLine()) {
				t.Errorf("pcr 13 events %+v", p13)
			}
			// The userspace log's events come last, in its order.
			if got := res.Events[len(res.Events)-3:]; got[0].PCR != 11 || got[1].PCR != 13 || got[2].PCR != 13 {
				t.Errorf("last events %+v", got)
			}
		})
	}
}

func mustReplay(t *testing.T, log []byte, pcrs map[uint32][]byte) []Event {
	t.Helper()
	evs, err := replayLog(log, pcrs)
	if err != nil {
		t.Fatal(err)
	}
	return evs
}

func eventEqual(a, b Event) bool {
	return a.PCR == b.PCR && a.Type == b.Type && a.Description == b.Description && bytes.Equal(a.Digest, b.Digest)
}

// A direct-kernel boot extends no PCR 11; its userspace log touches only
// what the firmware log does not. The firmware log replays as before, and a
// broken userspace log does not cost its events.
func TestDirectKernelStyleLogs(t *testing.T) {
	f := getFixture(t)
	nonce := newNonce(t)
	q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
	q.Stage, q.EventLog = ready, f.log
	before := mustVerify(t, q, nonce).Events // the firmware log alone

	sysext := fixtureWords()[1:]
	for _, tc := range []struct {
		name, err string
		log       []byte
		extra     int // userspace events kept
	}{
		{"pcr 13 only", "", userLog(sysext...), 2},
		{"a pcr that is not quoted", "", userLog(append(slices.Clone(sysext), word{15, "machine-id:0123", "machine-id"})...), 2},
		{"none", "", userLog(), 0},
		{"pcr 13 wrong", "userspace log does not replay to the quoted value of pcrs 13 after the event log's events of those pcrs; the event log replays without it, its events are kept",
			userLog(sysext[0]), 0},
		{"garbage", "userspace log does not parse: userspace log entry 1 is not a record", []byte("\x1e{garbage\n"), 0},
		// A UKI boot's userspace log with a firmware log that lacks the
		// stub's events: PCR 11 does not replay, the firmware log alone does.
		{"no section events", "userspace log does not replay to the quoted value of pcrs 11 after the event log's events of those pcrs; the event log replays without it, its events are kept",
			userLog(fixtureWords()...), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nonce := newNonce(t)
			q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
			q.Stage, q.EventLog, q.UserspaceLog = ready, f.log, tc.log
			res := mustVerify(t, q, nonce)
			if tc.err == "" && res.EventLogError != "" || !strings.Contains(res.EventLogError, tc.err) {
				t.Errorf("EventLogError = %q, want %q", res.EventLogError, tc.err)
			}
			if len(res.Events) != len(before)+tc.extra || !slices.EqualFunc(res.Events[:len(before)], before, eventEqual) {
				t.Errorf("events %+v, want the firmware log's %d and %d more", res.Events, len(before), tc.extra)
			}
			for _, e := range res.Events[len(before):] {
				if e.PCR != 13 || e.Type != TypeUserspace {
					t.Errorf("userspace event %+v", e)
				}
			}
		})
	}
}

// A UKI boot's logs that do not replay give no events at all: PCR 11 needs
// both, and the firmware log alone does not replay it.
func TestUKILogsUnusable(t *testing.T) {
	f := getFixture(t)
	words := fixtureWords()
	var tooMany []word
	for range measure.MaxLogRecords + 1 {
		tooMany = append(tooMany, word{11, "x", "phase"})
	}
	lying := userLog(words...)
	lying = bytes.Replace(lying, []byte(hex.EncodeToString(measure.Digest([]byte(measure.WordEnterInitrd)))), []byte(hex.EncodeToString(measure.Digest([]byte("leave-initrd")))), 1)
	fwPCR11 := "event log does not replay to the quoted value of pcrs 11"
	for _, tc := range []struct {
		name, err string
		fw, us    []byte
	}{
		{"firmware log alone", fwPCR11, f.ukiLog, nil},
		{"a phase too many", "userspace log does not replay to the quoted value of pcrs 11 after the event log's events of those pcrs; " + fwPCR11,
			f.ukiLog, userLog(append(slices.Clone(words), word{11, "leave-initrd", "phase"})...)},
		{"another sysext", "userspace log does not replay to the quoted value of pcrs 13 after",
			f.ukiLog, userLog(words[0], words[1], word{13, measure.SysextLine(strings.Repeat("ab", 32), measure.SysextFile(fixtureKubernetes)), "sysext"})},
		{"a digest changed", "userspace log does not replay to the quoted value of pcrs 11 after", f.ukiLog, lying},
		{"userspace log alone", "userspace log does not replay to the quoted value of pcrs 11", nil, f.userLog},
		{"too many records", "userspace log does not parse: userspace log has more than 1024 records", f.ukiLog, userLog(tooMany...)},
		{"firmware log garbage", "event log does not parse", []byte("garbage"), f.userLog},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nonce := newNonce(t)
			q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
			q.Stage, q.EventLog, q.UserspaceLog = ready, tc.fw, tc.us
			res := mustVerify(t, q, nonce)
			if !strings.Contains(res.EventLogError, tc.err) {
				t.Errorf("EventLogError = %q, want %q", res.EventLogError, tc.err)
			}
			if res.Events != nil {
				t.Errorf("events %+v, want none", res.Events)
			}
		})
	}
}

// Every event a result carries extends its PCR to the quoted value.
func checkEventsReplay(t *testing.T, evs []Event, pcrs map[uint32][]byte) {
	t.Helper()
	folded := map[uint32][]byte{}
	for _, e := range evs {
		if _, ok := pcrs[e.PCR]; !ok {
			t.Fatalf("event of pcr %d, which is not quoted", e.PCR)
		}
		if folded[e.PCR] == nil {
			folded[e.PCR] = make([]byte, sha256.Size)
		}
		folded[e.PCR] = measure.Extend(folded[e.PCR], e.Digest)
	}
	for p, v := range folded {
		if !bytes.Equal(v, pcrs[p]) {
			t.Fatalf("events of pcr %d fold to %x, quoted %x", p, v, pcrs[p])
		}
	}
}
