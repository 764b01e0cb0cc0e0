package attest

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/pkg/imdswire"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/google/go-tpm/tpm2/transport"
)

// Defaults (contract §5.3, §6.1).
const (
	DefaultIMDSURL          = imdsclient.DefaultURL
	DefaultTimeout          = 90 * time.Second
	DefaultEventLogPath     = "/sys/kernel/security/tpm0/binary_bios_measurements"
	DefaultUserspaceLogPath = measure.DefaultLogPath // vm-agent's extends (internal/pcrextend)

	firstBackoff = 250 * time.Millisecond
	maxBackoff   = 5 * time.Second
)

// Exit codes (contract §5.3).
const (
	ExitVerified = 0
	ExitError    = 1
	ExitRejected = 2
)

// Request and Response are the wire format shared with the IMDS.
type (
	Request  = imdswire.QuoteRequest
	Response = imdswire.QuoteResponse
)

// Config is one `vm-agent attest` run.
type Config struct {
	Stage            string
	IMDSURL          string
	TPMPath          string
	Timeout          time.Duration
	Print            bool   // print the request instead of posting it
	Nonce            []byte // use this nonce instead of asking the IMDS
	EventLogPath     string // empty: not sent
	UserspaceLogPath string // empty: not sent
	Stdout, Stderr   io.Writer
	HTTPClient       *http.Client
}

// rejectedError is a 403 (or a 200 that says unverified): final, exit 2.
type rejectedError struct{ msg string }

func (e *rejectedError) Error() string { return "Attestation rejected: " + e.msg }

// permanentError is not worth retrying (a foreign AK, a broken TPM).
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Run attests once, retrying failed attempts with backoff until cfg.Timeout, and
// returns the exit code.
func Run(ctx context.Context, cfg Config) int {
	if _, err := StagePCRs(cfg.Stage); err != nil {
		fmt.Fprintln(cfg.Stderr, "vm-agent attest:", err)
		return ExitError
	}
	if cfg.HTTPClient == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.Proxy = nil // the IMDS is link-local: never through a proxy
		cfg.HTTPClient = &http.Client{Transport: tr, Timeout: 15 * time.Second}
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()

	r := &runner{cfg: cfg}
	defer r.close()
	backoff := firstBackoff
	var last error
	for {
		err := r.attempt(ctx)
		var rej *rejectedError
		var perm *permanentError
		switch {
		case err == nil:
			return ExitVerified
		case errors.As(err, &rej):
			fmt.Fprintln(cfg.Stderr, rej.Error())
			return ExitRejected
		case errors.As(err, &perm):
			fmt.Fprintln(cfg.Stderr, "vm-agent attest:", err)
			return ExitError
		}
		if errors.Is(err, context.DeadlineExceeded) && last != nil {
			err = last // say why it kept failing, not that time ran out
		}
		last = err
		if ctx.Err() == nil {
			fmt.Fprintf(cfg.Stderr, "vm-agent attest: %v; retrying in %s\n", err, backoff)
			select {
			case <-ctx.Done():
			case <-time.After(backoff):
			}
		}
		if ctx.Err() != nil {
			fmt.Fprintf(cfg.Stderr, "vm-agent attest: giving up (timeout %s): %v\n", cfg.Timeout, err)
			return ExitError
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

type runner struct {
	cfg   Config
	tpm   transport.TPMCloser
	ak    *AK
	ekPub []byte
}

func (r *runner) close() {
	if r.tpm != nil {
		r.tpm.Close()
	}
}

// attempt is one nonce → quote → post round: nonces are single use, so a retry
// needs a fresh nonce and therefore a fresh quote.
func (r *runner) attempt(ctx context.Context) error {
	if r.tpm == nil {
		// Retried: early in the initrd the device may not exist yet.
		t, err := OpenTPM(r.cfg.TPMPath)
		if err != nil {
			return fmt.Errorf("opening the TPM: %w", err)
		}
		ak, err := LoadOrCreateAK(t)
		if err != nil {
			t.Close()
			return &permanentError{fmt.Errorf("attestation key: %w", err)}
		}
		// The EK is optional in the request.
		ekPub, err := EKPublic(t)
		if err != nil {
			fmt.Fprintf(r.cfg.Stderr, "vm-agent attest: warning: no EK to send: %v\n", err)
		}
		r.tpm, r.ak, r.ekPub = t, ak, ekPub
	}

	nonce := r.cfg.Nonce
	if nonce == nil {
		var err error
		if nonce, err = r.fetchNonce(ctx); err != nil {
			return err
		}
	}
	pcrs, _ := StagePCRs(r.cfg.Stage)
	q, err := TakeQuote(r.tpm, r.ak, nonce, pcrs)
	if err != nil {
		return &permanentError{err}
	}
	req := Request{
		Stage:        r.cfg.Stage,
		Nonce:        hex.EncodeToString(nonce),
		AKPub:        r.ak.Public,
		EKPub:        r.ekPub,
		Quote:        q.Attest,
		Signature:    q.Signature,
		PCRs:         map[string]map[string]string{"sha256": {}},
		EventLog:     readOptional(r.cfg.EventLogPath),
		UserspaceLog: readOptional(r.cfg.UserspaceLogPath),
	}
	for i, v := range q.PCRs {
		req.PCRs["sha256"][strconv.FormatUint(uint64(i), 10)] = hex.EncodeToString(v)
	}
	if r.cfg.Print {
		b, err := json.MarshalIndent(req, "", "  ")
		if err != nil {
			return &permanentError{err}
		}
		_, err = fmt.Fprintf(r.cfg.Stdout, "%s\n", b)
		return err
	}
	return r.post(ctx, req)
}

func (r *runner) fetchNonce(ctx context.Context) ([]byte, error) {
	u := strings.TrimSuffix(r.cfg.IMDSURL, "/") + "/attest/nonce"
	hreq, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, &permanentError{err}
	}
	rsp, err := r.cfg.HTTPClient.Do(hreq)
	if err != nil {
		return nil, err
	}
	defer rsp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(rsp.Body, 4096))
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", u, err)
	}
	if rsp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %s", u, rsp.Status, imdsclient.Snippet(body))
	}
	s := strings.TrimSpace(string(body))
	nonce, err := hex.DecodeString(s)
	if err != nil || len(s) != 64 {
		return nil, fmt.Errorf("GET %s: want 64 hex characters, got %q", u, imdsclient.Snippet(body))
	}
	return nonce, nil
}

func (r *runner) post(ctx context.Context, req Request) error {
	u := strings.TrimSuffix(r.cfg.IMDSURL, "/") + "/attest/quote"
	b, err := json.Marshal(req)
	if err != nil {
		return &permanentError{err}
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(b))
	if err != nil {
		return &permanentError{err}
	}
	hreq.Header.Set("Content-Type", "application/json")
	rsp, err := r.cfg.HTTPClient.Do(hreq)
	if err != nil {
		return err
	}
	defer rsp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(rsp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("POST %s: %w", u, err)
	}
	var res Response
	jsonErr := json.Unmarshal(body, &res)
	switch {
	case rsp.StatusCode == http.StatusOK && jsonErr == nil && res.Verified:
		if res.Message == "" {
			fmt.Fprintln(r.cfg.Stdout, "attestation verified")
		} else {
			fmt.Fprintln(r.cfg.Stdout, "attestation verified:", res.Message)
		}
		return nil
	case rsp.StatusCode == http.StatusOK && jsonErr == nil, rsp.StatusCode == http.StatusForbidden:
		msg := res.Message
		if jsonErr != nil || msg == "" {
			msg = imdsclient.Snippet(body)
		}
		if msg == "" {
			msg = "(no reason given)"
		}
		return &rejectedError{msg}
	}
	return fmt.Errorf("POST %s: %s: %s", u, rsp.Status, imdsclient.Snippet(body))
}

// readOptional returns the file's content, or nil if it is absent or unreadable
// (securityfs not mounted, no systemd-pcrextend yet).
func readOptional(path string) []byte {
	if path == "" {
		return nil
	}
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 {
		return nil
	}
	return b
}
