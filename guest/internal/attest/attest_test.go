package attest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/giantswarm/vm-manager/guest/internal/swtpmtest"
	"github.com/giantswarm/vm-manager/pkg/vtpm"
)

func runAttest(t *testing.T, cfg Config) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	cfg.Stdout, cfg.Stderr = &out, &errb
	if cfg.Timeout == 0 {
		cfg.Timeout = 30 * time.Second
	}
	code = Run(context.Background(), cfg)
	t.Logf("attest --stage=%s: exit %d\nstdout: %s\nstderr: %s", cfg.Stage, code, out.String(), errb.String())
	return code, out.String(), errb.String()
}

func runCommand(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Command(args, &out, &errb)
	t.Logf("attest %q: exit %d\nstdout: %s\nstderr: %s", args, code, out.String(), errb.String())
	return code, out.String(), errb.String()
}

// expectedPCR is what extend leaves in a PCR that started at zero.
func expectedPCR(i uint) string {
	d := sha256.Sum256([]byte{byte(i), 'x'})
	v := sha256.Sum256(append(make([]byte, 32), d[:]...))
	return hex.EncodeToString(v[:])
}

func readPublic(t *testing.T, tpm transport.TPM, h tpm2.TPMHandle) ([]byte, error) {
	t.Helper()
	rsp, err := tpm2.ReadPublic{ObjectHandle: h}.Execute(tpm)
	if err != nil {
		return nil, err
	}
	return rsp.OutPublic.Bytes(), nil
}

func TestAttestInitrdAndReady(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	imds := newFakeIMDS(t)
	withTPM(t, sw.Socket(), func(tpm transport.TPM) { extend(t, tpm, 0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13, 15) })

	for _, stage := range []string{StageInitrd, StageReady} {
		code, out, _ := runAttest(t, Config{Stage: stage, IMDSURL: imds.URL, TPMPath: sw.Socket()})
		if code != ExitVerified || !strings.HasPrefix(out, "attestation verified: verified: ak ") {
			t.Fatalf("stage %s: exit %d, stdout %q", stage, code, out)
		}
	}
	reqs := imds.verified()
	if len(reqs) != 2 {
		t.Fatalf("%d verified requests, want 2", len(reqs))
	}
	for i, want := range [][]string{
		{"0", "1", "11", "12", "15", "2", "3", "4", "5", "6", "7", "9"},
		{"0", "1", "11", "12", "13", "15", "2", "3", "4", "5", "6", "7", "9"},
	} {
		got := reqs[i].PCRs["sha256"]
		if keys := slices.Sorted(maps.Keys(got)); !slices.Equal(keys, want) {
			t.Errorf("%s: PCRs %v, want %v", reqs[i].Stage, keys, want)
		}
		for k, v := range got {
			n, _ := strconv.Atoi(k)
			if v != expectedPCR(uint(n)) {
				t.Errorf("%s: PCR %s = %s, want %s", reqs[i].Stage, k, v, expectedPCR(uint(n)))
			}
		}
	}
	// No EK was provisioned, so it is derived from the TCG template.
	ek, err := tpm2.Unmarshal[tpm2.TPMTPublic](reqs[0].EKPub)
	if err != nil {
		t.Fatalf("ek_pub: %v", err)
	}
	if rsa, err := ek.Parameters.RSADetail(); ek.Type != tpm2.TPMAlgRSA || err != nil || rsa.KeyBits != 2048 || !ek.ObjectAttributes.AdminWithPolicy {
		t.Errorf("ek_pub is not the RSA-2048 EK: %+v", ek)
	}
	if !bytes.Equal(reqs[0].EKPub, reqs[1].EKPub) {
		t.Error("the derived EK differs between runs")
	}
}

func TestPersistedEKIsSent(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	var ekPub []byte
	withTPM(t, sw.Socket(), func(tpm transport.TPM) {
		// An ECC EK, so it differs from the RSA one vm-agent would derive.
		ek, err := tpm2.CreatePrimary{PrimaryHandle: tpm2.TPMRHEndorsement, InPublic: tpm2.New2B(tpm2.ECCEKTemplate)}.Execute(tpm)
		if err != nil {
			t.Fatal(err)
		}
		defer flush(tpm, ek.ObjectHandle)
		if _, err := (tpm2.EvictControl{Auth: tpm2.TPMRHOwner, ObjectHandle: tpm2.NamedHandle{Handle: ek.ObjectHandle, Name: ek.Name}, PersistentHandle: EKHandle}).Execute(tpm); err != nil {
			t.Fatal(err)
		}
		ekPub = ek.OutPublic.Bytes()
	})
	code, out, _ := runAttest(t, Config{Stage: StageInitrd, Print: true, Nonce: []byte{1, 2, 3}, TPMPath: sw.Socket()})
	var req Request
	if code != 0 || json.Unmarshal([]byte(out), &req) != nil {
		t.Fatalf("exit %d", code)
	}
	if !bytes.Equal(req.EKPub, ekPub) {
		t.Errorf("ek_pub is not the key at %#x", uint32(EKHandle))
	}
}

func TestAKPersistsAndIsReused(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	imds := newFakeIMDS(t)
	withTPM(t, sw.Socket(), func(tpm transport.TPM) {
		if _, err := readPublic(t, tpm, AKHandle); !errors.Is(err, tpm2.TPMRCHandle) {
			t.Fatalf("fresh TPM: handle %#x: %v, want TPM_RC_HANDLE", uint32(AKHandle), err)
		}
	})
	if code, _, _ := runAttest(t, Config{Stage: StageInitrd, IMDSURL: imds.URL, TPMPath: sw.Socket()}); code != 0 {
		t.Fatalf("first run: exit %d", code)
	}
	checkTPM := func() {
		withTPM(t, sw.Socket(), func(tpm transport.TPM) {
			pub, err := readPublic(t, tpm, AKHandle)
			if err != nil {
				t.Fatalf("AK not persisted: %v", err)
			}
			if reqs := imds.verified(); !bytes.Equal(pub, reqs[len(reqs)-1].AKPub) {
				t.Error("ak_pub is not the key at the AK handle")
			}
			if h := transientHandles(t, tpm); len(h) != 0 {
				t.Errorf("transient handles left loaded: %v", h)
			}
		})
	}
	checkTPM()

	// A new boot: swtpm restarts on the same state.
	sw.Stop()
	sw = swtpmtest.Start(t, sw.Dir())
	if code, _, _ := runAttest(t, Config{Stage: StageReady, IMDSURL: imds.URL, TPMPath: sw.Socket()}); code != 0 {
		t.Fatalf("second run: exit %d", code)
	}
	checkTPM()
	reqs := imds.verified()
	if !bytes.Equal(reqs[0].AKPub, reqs[1].AKPub) {
		t.Error("the second run used a different AK")
	}
}

func TestForeignKeyAtAKHandleIsRefused(t *testing.T) {
	unrestricted := AKTemplate()
	unrestricted.ObjectAttributes.Restricted = false
	for name, tmpl := range map[string]tpm2.TPMTPublic{
		"storage key":            tpm2.ECCSRKTemplate,
		"unrestricted ECDSA key": unrestricted,
	} {
		t.Run(name, func(t *testing.T) {
			sw := swtpmtest.Start(t, "")
			imds := newFakeIMDS(t)
			var foreign []byte
			withTPM(t, sw.Socket(), func(tpm transport.TPM) {
				k, err := tpm2.CreatePrimary{PrimaryHandle: tpm2.TPMRHOwner, InPublic: tpm2.New2B(tmpl)}.Execute(tpm)
				if err != nil {
					t.Fatal(err)
				}
				defer flush(tpm, k.ObjectHandle)
				if _, err := (tpm2.EvictControl{Auth: tpm2.TPMRHOwner, ObjectHandle: tpm2.NamedHandle{Handle: k.ObjectHandle, Name: k.Name}, PersistentHandle: AKHandle}).Execute(tpm); err != nil {
					t.Fatal(err)
				}
				foreign = k.OutPublic.Bytes()
			})

			code, _, stderr := runAttest(t, Config{Stage: StageInitrd, IMDSURL: imds.URL, TPMPath: sw.Socket()})
			if code != ExitError || !strings.Contains(stderr, "foreign key") || !strings.Contains(stderr, "0x81010002") || !strings.Contains(stderr, "refusing") {
				t.Errorf("exit %d, stderr %q: want exit 1 and a foreign-key error", code, stderr)
			}
			if strings.Contains(stderr, "retrying") || imds.gets != 0 || imds.posts != 0 {
				t.Errorf("a foreign key must fail at once (gets %d, posts %d)", imds.gets, imds.posts)
			}
			withTPM(t, sw.Socket(), func(tpm transport.TPM) {
				if pub, err := readPublic(t, tpm, AKHandle); err != nil || !bytes.Equal(pub, foreign) {
					t.Errorf("the foreign key was touched: %v", err)
				}
			})
		})
	}
}

func TestRejectedExitsTwo(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	imds := newFakeIMDS(t)
	withTPM(t, sw.Socket(), func(tpm transport.TPM) { extend(t, tpm, 11) })
	golden := bytes.Repeat([]byte{0xaa}, 32)
	imds.policy = func(stage string, pcrs map[uint][]byte) error {
		if !bytes.Equal(pcrs[11], golden) {
			return fmt.Errorf("pcr 11 mismatch for phase enter-initrd: expected %x, got %x", golden, pcrs[11])
		}
		return nil
	}
	wantLine := fmt.Sprintf("Attestation rejected: pcr 11 mismatch for phase enter-initrd: expected %x, got %s", golden, expectedPCR(11))

	code, out, stderr := runCommand(t, "--stage=initrd", "--imds-url", imds.URL, "--tpm", sw.Socket(), "--timeout", "20s")
	if code != ExitRejected || !slices.Contains(strings.Split(stderr, "\n"), wantLine) || out != "" {
		t.Errorf("exit %d, stderr %q: want exit 2 and the line %q", code, stderr, wantLine)
	}
	if imds.posts != 1 {
		t.Errorf("%d POSTs: a rejection must not be retried", imds.posts)
	}

	// A nonce the IMDS never issued is rejected as well.
	code, _, stderr = runCommand(t, "--stage", "ready", "--imds-url", imds.URL, "--tpm", sw.Socket(), "--nonce", strings.Repeat("ab", 32))
	if code != ExitRejected || !strings.Contains(stderr, "Attestation rejected: unknown or expired nonce\n") {
		t.Errorf("exit %d, stderr %q", code, stderr)
	}
}

func TestRetriesUntilTheServerRecovers(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	imds := newFakeIMDS(t)
	imds.failPosts = 2
	start := time.Now()
	code, out, stderr := runAttest(t, Config{Stage: StageInitrd, IMDSURL: imds.URL, TPMPath: sw.Socket()})
	if code != ExitVerified || !strings.HasPrefix(out, "attestation verified: ") {
		t.Fatalf("exit %d", code)
	}
	if imds.posts != 3 || imds.gets != 3 {
		t.Errorf("%d POSTs, %d nonces: want 3 of each (a fresh nonce per attempt)", imds.posts, imds.gets)
	}
	if !strings.Contains(stderr, "500 Internal Server Error: attestor unavailable; retrying in 250ms") ||
		!strings.Contains(stderr, "retrying in 500ms") || strings.Contains(stderr, "retrying in 1s") {
		t.Errorf("stderr %q: want retries after 250ms and 500ms", stderr)
	}
	if d := time.Since(start); d < 750*time.Millisecond {
		t.Errorf("finished after %s: no backoff", d)
	}
}

func TestGivesUpAtTheTimeout(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	imds := newFakeIMDS(t)
	imds.failPosts = 1 << 30
	start := time.Now()
	code, _, stderr := runAttest(t, Config{Stage: StageInitrd, IMDSURL: imds.URL, TPMPath: sw.Socket(), Timeout: 1200 * time.Millisecond})
	d := time.Since(start)
	if code != ExitError || !strings.Contains(stderr, "giving up (timeout 1.2s): POST ") {
		t.Errorf("exit %d, stderr %q", code, stderr)
	}
	if d < 1200*time.Millisecond || d > 3*time.Second {
		t.Errorf("gave up after %s, want about 1.2s", d)
	}
	if imds.posts < 3 {
		t.Errorf("only %d attempts in 1.2s", imds.posts)
	}
}

func TestPrint(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	dir := t.TempDir()
	eventLog, userLog := filepath.Join(dir, "binary_bios_measurements"), filepath.Join(dir, "tpm2-measure.log")
	os.WriteFile(eventLog, []byte("firmware events"), 0o644)
	os.WriteFile(userLog, []byte("userspace events"), 0o644)
	nonce := bytes.Repeat([]byte{0x5a}, 32)

	code, out, _ := runAttest(t, Config{
		Stage: StageReady, Print: true, Nonce: nonce, TPMPath: sw.Socket(),
		IMDSURL:      "http://127.0.0.1:1", // must not be contacted
		EventLogPath: eventLog, UserspaceLogPath: userLog,
	})
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal([]byte(out), &fields); err != nil {
		t.Fatalf("not JSON: %v", err)
	}
	for _, k := range []string{"stage", "nonce", "ak_pub", "ek_pub", "quote", "signature", "pcrs", "event_log", "userspace_log"} {
		if _, ok := fields[k]; !ok {
			t.Errorf("field %s missing", k)
		}
	}
	var req Request
	if err := json.Unmarshal([]byte(out), &req); err != nil {
		t.Fatal(err)
	}
	if req.Stage != StageReady || req.Nonce != hex.EncodeToString(nonce) ||
		string(req.EventLog) != "firmware events" || string(req.UserspaceLog) != "userspace events" {
		t.Errorf("request %+v", req)
	}
	if _, _, err := verifyRequest(req, nonce); err != nil {
		t.Errorf("printed request does not verify: %v", err)
	}

	// Through the CLI flags; the default log paths may not exist here.
	code, out, _ = runCommand(t, "--stage=initrd", "--print", "--nonce", hex.EncodeToString(nonce), "--tpm", sw.Socket(), "--imds-url", "http://127.0.0.1:1")
	if err := json.Unmarshal([]byte(out), &req); code != 0 || err != nil || req.Stage != StageInitrd {
		t.Fatalf("exit %d, %v", code, err)
	}
	if _, _, err := verifyRequest(req, nonce); err != nil {
		t.Errorf("printed request does not verify: %v", err)
	}
}

// The test verifier must catch tampering, or the tests above prove little.
func TestVerifierCatchesTampering(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	withTPM(t, sw.Socket(), func(tpm transport.TPM) { extend(t, tpm, 13) })
	nonce := []byte("0123456789abcdef0123456789abcdef")
	printReq := func(stage string) Request {
		_, out, _ := runAttest(t, Config{Stage: stage, Print: true, Nonce: nonce, TPMPath: sw.Socket()})
		var req Request
		if err := json.Unmarshal([]byte(out), &req); err != nil {
			t.Fatal(err)
		}
		if _, _, err := verifyRequest(req, nonce); err != nil {
			t.Fatalf("untampered request: %v", err)
		}
		return req
	}
	initrd, ready := printReq(StageInitrd), printReq(StageReady)

	for name, c := range map[string]struct {
		tamper func(*Request)
		nonce  []byte
		want   string
	}{
		"pcr value":       {func(r *Request) { r.PCRs["sha256"]["13"] = strings.Repeat("00", 32) }, nonce, "pcrDigest"},
		"missing pcr":     {func(r *Request) { delete(r.PCRs["sha256"], "0") }, nonce, "PCR 0 missing"},
		"other nonce":     {func(*Request) {}, []byte("another nonce"), "qualifying data"},
		"quote byte":      {func(r *Request) { r.Quote[len(r.Quote)-1] ^= 1 }, nonce, "signature does not verify"},
		"other ak":        {func(r *Request) { r.AKPub = append([]byte(nil), r.EKPub...) }, nonce, "ak_pub"},
		"stage coverage":  {func(r *Request) { *r = initrd; r.Stage = StageReady }, nonce, "does not cover PCR 13"},
		"signature bytes": {func(r *Request) { r.Signature[len(r.Signature)-1] ^= 1 }, nonce, "signature does not verify"},
	} {
		req := ready
		req.PCRs = map[string]map[string]string{"sha256": {}}
		for k, v := range ready.PCRs["sha256"] {
			req.PCRs["sha256"][k] = v
		}
		req.Quote = bytes.Clone(ready.Quote)
		req.Signature = bytes.Clone(ready.Signature)
		c.tamper(&req)
		if _, _, err := verifyRequest(req, c.nonce); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error with %q", name, err, c.want)
		}
	}
}

func TestStartupWhenTheTPMWasNotStarted(t *testing.T) {
	sw := swtpmtest.Start(t, "", swtpmtest.Flags("not-need-init")) // no startup-clear
	raw, err := vtpm.DialSocket(sw.Socket(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tpm2.GetCapability{Capability: tpm2.TPMCapTPMProperties, Property: uint32(tpm2.TPMPTManufacturer), PropertyCount: 1}.Execute(raw)
	raw.Close()
	if !errors.Is(err, tpm2.TPMRCInitialize) {
		t.Fatalf("unstarted swtpm answered %v, want TPM_RC_INITIALIZE", err)
	}
	var out, errb bytes.Buffer
	if code := PCRsCommand([]string{"--tpm", sw.Socket()}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	// And a second open finds it started.
	withTPM(t, sw.Socket(), func(transport.TPM) {})
}

func TestPCRsCommand(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	withTPM(t, sw.Socket(), func(tpm transport.TPM) { extend(t, tpm, 11) })
	var out, errb bytes.Buffer
	if code := PCRsCommand([]string{"--bank=sha256", "--tpm=" + sw.Socket()}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 24 {
		t.Fatalf("%d lines, want 24:\n%s", len(lines), out.String())
	}
	line := regexp.MustCompile(`^([0-9]+) ([0-9a-f]{64})$`)
	for i, l := range lines {
		m := line.FindStringSubmatch(l)
		if m == nil || m[1] != strconv.Itoa(i) {
			t.Errorf("line %d: %q", i, l)
		}
	}
	if want := "11 " + expectedPCR(11); lines[11] != want {
		t.Errorf("got %q, want %q", lines[11], want)
	}

	out.Reset()
	if code := PCRsCommand([]string{"--bank", "sha1", "--tpm", sw.Socket()}, &out, &errb); code != 0 || !regexp.MustCompile(`(?m)^23 [0-9a-f]{40}$`).MatchString(out.String()) {
		t.Errorf("sha1: exit %d, %q", code, out.String())
	}
	if code := PCRsCommand([]string{"--bank=md5", "--tpm", sw.Socket()}, &out, &errb); code != 2 {
		t.Errorf("unknown bank: exit %d, want 2", code)
	}
}

func TestCommandFlagErrors(t *testing.T) {
	for _, args := range [][]string{
		{},                                   // no stage
		{"--stage=boot"},                     // unknown stage
		{"--stage=initrd", "--nonce=xyz"},    // not hex
		{"--stage=initrd", "--timeout=0s"},   // no time at all
		{"--stage=initrd", "extra-argument"}, // stray argument
		{"--stage=initrd", "--no-such-flag"},
	} {
		// 1, never 2: a caller reads 2 as "rejected".
		if code, _, _ := runCommand(t, args...); code != ExitError {
			t.Errorf("%q: exit %d, want 1", args, code)
		}
	}
}

func TestTPMMissing(t *testing.T) {
	code, _, stderr := runAttest(t, Config{Stage: StageInitrd, TPMPath: filepath.Join(t.TempDir(), "tpmrm0"), Timeout: 600 * time.Millisecond})
	if code != ExitError || !strings.Contains(stderr, "opening the TPM") || !strings.Contains(stderr, "retrying") {
		t.Errorf("exit %d, stderr %q: want retries, then exit 1", code, stderr)
	}
}

func TestResponseHandling(t *testing.T) {
	sw := swtpmtest.Start(t, "")
	for _, c := range []struct {
		status     int
		body, want string
		code       int
	}{
		{200, `{"stage":"initrd","verified":false,"message":"not verified"}`, "Attestation rejected: not verified\n", ExitRejected},
		{403, "forbidden: client address is not a managed VM\n", "Attestation rejected: forbidden: client address is not a managed VM\n", ExitRejected},
		{200, "not JSON", "giving up (timeout 600ms): POST ", ExitError},
		{409, `{"message":"conflict"}`, "409 Conflict", ExitError},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet {
				fmt.Fprint(w, strings.Repeat("0f", 32))
				return
			}
			w.WriteHeader(c.status)
			fmt.Fprint(w, c.body)
		}))
		code, _, stderr := runAttest(t, Config{Stage: StageInitrd, IMDSURL: srv.URL, TPMPath: sw.Socket(), Timeout: 600 * time.Millisecond})
		srv.Close()
		if code != c.code || !strings.Contains(stderr, c.want) {
			t.Errorf("%d %q: exit %d, stderr %q; want exit %d and %q", c.status, c.body, code, stderr, c.code, c.want)
		}
	}
}
