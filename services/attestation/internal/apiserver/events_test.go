package apiserver

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"unicode/utf16"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/types/known/structpb"
)

type section struct{ name, content string }

var (
	ukiSections = []section{{".linux", "vmlinuz"}, {".osrel", "ID=test"}, {".cmdline", "console=ttyS0"}, {".initrd", "initrd"}}
	k8s         = "1.31.4"
	sysextHash  = hex.EncodeToString(measure.Digest([]byte("kubernetes_1.31.4.raw")))
)

func sectionDigests(secs []section) map[string][]byte {
	m := map[string][]byte{}
	for _, s := range secs {
		m[s.name] = measure.Digest([]byte(s.content))
	}
	return m
}

// stubLog is the firmware log of systemd-stub's PCR 11 events (TCG PC
// Client crypto-agile format, sha256 only): for each section its name with
// the NUL, then its contents, each an EV_IPL described in UTF-16.
func stubLog(secs []section) []byte {
	le32 := func(b []byte, v uint32) []byte { return binary.LittleEndian.AppendUint32(b, v) }
	spec := append([]byte("Spec ID Event03\x00"), 0, 0, 0, 0, 0, 2, 0, 2) // platform class, 2.0 errata 0, UINTN 8 bytes
	spec = le32(spec, 1)
	spec = append(spec, 0x0b, 0, 32, 0, 0) // sha256, 32 bytes; no vendor info
	b := le32(le32(nil, 0), 3)             // pcr 0, EV_NO_ACTION
	b = le32(append(b, make([]byte, 20)...), uint32(len(spec)))
	b = append(b, spec...)
	for _, s := range secs {
		var desc []byte
		for _, c := range utf16.Encode([]rune(s.name + "\x00")) {
			desc = binary.LittleEndian.AppendUint16(desc, c)
		}
		for _, m := range [][]byte{append([]byte(s.name), 0), []byte(s.content)} {
			b = le32(le32(le32(b, 11), 0x0d), 1) // pcr 11, EV_IPL, one digest
			b = append(append(b, 0x0b, 0), measure.Digest(m)...)
			b = append(le32(b, uint32(len(desc))), desc...)
		}
	}
	return b
}

type record struct {
	pcr       uint32
	word, typ string
}

func userspaceLog(recs ...record) []byte {
	var b bytes.Buffer
	for _, r := range recs {
		if err := measure.WriteRecord(&b, measure.WordRecord(r.pcr, r.word, r.typ, "", 0)); err != nil {
			panic(err)
		}
	}
	return b.Bytes()
}

// ukiPolicy expects ukiSections and kubernetes k8s's sysext; every golden
// firmware PCR is zero.
func ukiPolicy(t *testing.T, s *Server) {
	t.Helper()
	z := strings.Repeat("0", 64)
	secs, p11 := map[string]any{}, map[string]any{}
	for k, v := range sectionDigests(ukiSections) {
		secs[k] = hex.EncodeToString(v)
	}
	for _, phase := range []string{measure.PhaseInitrd, measure.PhaseReady} {
		v, _ := measure.PCR11(sectionDigests(ukiSections), phase)
		p11[phase] = hex.EncodeToString(v)
	}
	doc, err := structpb.NewStruct(map[string]any{
		"uki":    map[string]any{"sections": secs},
		"pcr11":  p11,
		"sysext": map[string]any{k8s: sysextHash},
		"pcr13":  map[string]any{k8s: hex.EncodeToString(measure.PCR13(measure.SysextLine(sysextHash, measure.SysextFile(k8s))))},
		"golden": map[string]any{"sha256": map[string]any{"0": z, "2": z, "3": z, "4": z, "6": z, "7": z}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: doc}); err != nil {
		t.Fatal(err)
	}
}

// A UKI boot's quote with both logs: a mismatch names the event, from the
// policy for PCRs 11 and 13, from the stored golden boot for the others.
func TestUKIMismatchNamesTheEvent(t *testing.T) {
	s, st, _ := newServer(t, tempDB(t), Options{Mode: attestationv1.Mode_MODE_VERIFY})
	ukiPolicy(t, s)
	k := softAK(t)
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true, AkPublic: k.Public, KubernetesVersion: k8s}); err != nil {
		t.Fatal(err)
	}
	// The golden boot's events would name PCR 11 (and 0) too if asked.
	golden := []verify.Event{{PCR: 0, Type: "EV_POST_CODE", Description: "golden firmware", Digest: measure.Digest([]byte("fw"))},
		{PCR: 11, Type: "EV_IPL", Description: ".linux", Digest: measure.Digest([]byte("old"))}}
	if err := st.PutGoldenEvents(img, golden); err != nil {
		t.Fatal(err)
	}
	changed := []section{ukiSections[0], ukiSections[1], {".cmdline", "console=ttyS0 init=/bin/sh"}, ukiSections[3]}
	initrdWords := []record{{11, measure.WordEnterInitrd, measure.EventTypePhase}}
	var readyWords []record
	for _, w := range measure.PhaseWords(measure.PhaseReady) {
		readyWords = append(readyWords, record{11, w, measure.EventTypePhase})
	}
	otherHash := hex.EncodeToString(measure.Digest([]byte("another kubernetes_1.31.4.raw")))
	sysext := func(hash string) []record {
		return []record{{13, measure.WordOSSeparator, measure.EventTypeOSSeparator}, {13, measure.SysextLine(hash, measure.SysextFile(k8s)), measure.EventTypeSysext}}
	}
	for _, tc := range []struct {
		name    string
		stage   attestationv1.Stage
		secs    []section
		words   []record // what the TPM holds after the stub's events
		logged  []record // what the userspace log says
		pcr0    byte
		want    string // the end of the message
		mismPCR []uint32
	}{
		{name: ".cmdline changed", stage: attestationv1.Stage_STAGE_INITRD, secs: changed, words: initrdWords, logged: initrdWords,
			want:    fmt.Sprintf("; first differing event: uki section .cmdline (expected %x, got %x)", measure.Digest([]byte("console=ttyS0"))[:8], measure.Digest([]byte("console=ttyS0 init=/bin/sh"))[:8]),
			mismPCR: []uint32{11}},
		{name: ".initrd changed, at ready", stage: attestationv1.Stage_STAGE_READY, secs: []section{ukiSections[0], ukiSections[1], ukiSections[2], {".initrd", "another initrd"}},
			words: append(readyWords, sysext(sysextHash)...), logged: append(readyWords, sysext(sysextHash)...),
			want:    fmt.Sprintf("; first differing event: uki section .initrd (expected %x, got %x)", measure.Digest([]byte("initrd"))[:8], measure.Digest([]byte("another initrd"))[:8]),
			mismPCR: []uint32{11}},
		{name: "a userspace log that does not replay", stage: attestationv1.Stage_STAGE_INITRD, secs: changed, words: initrdWords,
			logged: append(initrdWords, record{11, measure.WordLeaveInitrd, measure.EventTypePhase})},
		{name: "another sysext, pcr 0 too", stage: attestationv1.Stage_STAGE_READY, secs: ukiSections, words: append(readyWords, sysext(otherHash)...), logged: append(readyWords, sysext(otherHash)...), pcr0: 1,
			want:    fmt.Sprintf(" for kubernetes %s; first differing event: sysext %q (expected %q)", k8s, measure.SysextLine(otherHash, "kubernetes_1.31.4.raw"), measure.SysextLine(sysextHash, "kubernetes_1.31.4.raw")),
			mismPCR: []uint32{0, 13}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pcrs := zeros(tc.stage)
			pcrs[0][0] = tc.pcr0
			evs, _ := measure.SectionEvents(sectionDigests(tc.secs))
			for _, r := range tc.words {
				evs = append(evs, measure.WordEvent(r.pcr, r.word))
			}
			for _, e := range evs {
				pcrs[e.PCR] = measure.Extend(pcrs[e.PCR], e.Digest)
			}
			nonce := nonceFor(t, s, vmA)
			att, sig, err := k.Quote(nonce, pcrs)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := s.VerifyQuote(ctx, &attestationv1.VerifyQuoteRequest{VmId: vmA, Stage: tc.stage, Nonce: nonce, AkPub: k.Public, Quote: att, Signature: sig, Pcrs: pcrs,
				EventLog: stubLog(tc.secs), UserspaceLog: userspaceLog(tc.logged...)})
			if err != nil {
				t.Fatal(err)
			}
			q := resp.GetAttestation().GetInitrd()
			if tc.stage == attestationv1.Stage_STAGE_READY {
				q = resp.GetAttestation().GetReady()
			}
			t.Logf("verdict: %s", resp.GetMessage())
			if resp.GetVerified() {
				t.Fatal("verified")
			}
			if tc.want == "" {
				if strings.Contains(resp.GetMessage(), "first differing") || len(q.GetMismatchedEvents()) != 0 {
					t.Errorf("named events from logs that do not replay: %q, %v", resp.GetMessage(), q.GetMismatchedEvents())
				}
				return
			}
			if !strings.HasSuffix(resp.GetMessage(), tc.want) {
				t.Errorf("message %q, want it to end in %q", resp.GetMessage(), tc.want)
			}
			var got []uint32
			for _, m := range q.GetMismatchedEvents() {
				got = append(got, m.GetPcr())
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.mismPCR) {
				t.Errorf("mismatched events of pcrs %v, want %v: %v", got, tc.mismPCR, q.GetMismatchedEvents())
			}
		})
	}
}
