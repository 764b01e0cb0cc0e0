// Package imdsclient is the guest's client for vm-manager's IMDS (contract §6): plain-text
// keys under http://169.254.169.254/giantswarm/v1, the caller identified by its IP.
package imdsclient

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// DefaultURL is the IMDS base URL (contract §6.1).
const DefaultURL = "http://169.254.169.254/giantswarm/v1"

// ErrNotFound is a 404: the key is unset.
var ErrNotFound = errors.New("not found")

// ErrNoUserData is a 204 on /user-data: the VM has none.
var ErrNoUserData = errors.New("no user-data")

// ErrGated is /user-data still answering 503 when the wait ran out.
var ErrGated = errors.New("user-data still gated")

// Client fetches keys with a short per-request timeout and a few retries.
type Client struct {
	BaseURL  string
	HTTP     *http.Client
	Attempts int           // per key, for transport errors and 5xx other than the user-data gate; default 3
	Backoff  time.Duration // between attempts, doubling; default 200 ms

	// For tests: the clock the 503 wait uses.
	Now   func() time.Time
	Sleep func(ctx context.Context, d time.Duration) error
}

// New returns a client with the boot defaults: 3 s per request, never via a proxy.
func New(baseURL string) *Client {
	tr := &http.Transport{
		Proxy:                 nil, // link-local: never through a proxy
		DialContext:           (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
		ResponseHeaderTimeout: 3 * time.Second,
		MaxIdleConnsPerHost:   2,
		IdleConnTimeout:       30 * time.Second,
	}
	return &Client{BaseURL: baseURL, HTTP: &http.Client{Transport: tr, Timeout: 5 * time.Second}}
}

func (c *Client) attempts() int {
	if c.Attempts <= 0 {
		return 3
	}
	return c.Attempts
}

func (c *Client) now() time.Time {
	if c.Now != nil {
		return c.Now()
	}
	return time.Now()
}

func (c *Client) sleep(ctx context.Context, d time.Duration) error {
	if c.Sleep != nil {
		return c.Sleep(ctx, d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Response is one answer.
type Response struct {
	Status     int
	Body       []byte
	RetryAfter string
}

// get does one GET of key (a path under the base URL, e.g. "/hostname").
func (c *Client) get(ctx context.Context, key string) (*Response, error) {
	u := strings.TrimSuffix(c.BaseURL, "/") + key
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	rsp, err := c.HTTP.Do(req)
	if err != nil {
		return nil, err
	}
	defer rsp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(rsp.Body, 32<<20))
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", key, err)
	}
	return &Response{Status: rsp.StatusCode, Body: body, RetryAfter: rsp.Header.Get("Retry-After")}, nil
}

// Get fetches key, retrying transport errors and 5xx; pass is the set of
// statuses returned as they are rather than retried (always 200 and 404).
func (c *Client) Get(ctx context.Context, key string, pass ...int) (*Response, error) {
	var got *Response
	err := c.retry(ctx, func() (retry bool, err error) {
		r, err := c.get(ctx, key)
		if err != nil {
			return true, err
		}
		switch {
		case r.Status == http.StatusOK, r.Status == http.StatusNotFound:
			got = r
			return false, nil
		case slices.Contains(pass, r.Status):
			got = r
			return false, nil
		case r.Status >= 500:
			return true, fmt.Errorf("GET %s: %d %s: %s", key, r.Status, http.StatusText(r.Status), Snippet(r.Body))
		default:
			got = r
			return false, fmt.Errorf("GET %s: %d %s: %s", key, r.Status, http.StatusText(r.Status), Snippet(r.Body))
		}
	})
	return got, err
}

// retry runs attempt up to Attempts times, waiting Backoff (doubled after
// each wait) between them, until one says not to retry: its error is the
// answer. When the attempts or ctx run out first, the answer is the last
// attempt's error, or ctx's when there was none.
func (c *Client) retry(ctx context.Context, attempt func() (retry bool, err error)) error {
	backoff := c.Backoff
	if backoff <= 0 {
		backoff = 200 * time.Millisecond
	}
	var last error
	for i := 0; i < c.attempts(); i++ {
		if i > 0 {
			if err := c.sleep(ctx, backoff); err != nil {
				break
			}
			backoff *= 2
		}
		retry, err := attempt()
		if !retry {
			return err
		}
		last = err
	}
	if last == nil {
		last = ctx.Err()
	}
	return last
}

// Text fetches a plain-text key; ErrNotFound for a 404.
func (c *Client) Text(ctx context.Context, key string) (string, error) {
	r, err := c.Get(ctx, key)
	if err != nil {
		return "", err
	}
	if r.Status == http.StatusNotFound {
		return "", ErrNotFound
	}
	return string(r.Body), nil
}

// Hostname is /hostname, trimmed.
func (c *Client) Hostname(ctx context.Context) (string, error) {
	s, err := c.Text(ctx, "/hostname")
	return strings.TrimSpace(s), err
}

// PublicKeys lists /public-keys/ and fetches each /public-keys/{n}, in index order.
// Keys that vanish between the list and the fetch (404) are skipped.
func (c *Client) PublicKeys(ctx context.Context) ([]string, error) {
	idx, err := c.Text(ctx, "/public-keys/")
	if errors.Is(err, ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var keys []string
	for _, line := range strings.Split(idx, "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		// The index is "<n>" (or EC2's "<n>=<name>"): only the number is used.
		n, _, _ := strings.Cut(line, "=")
		if _, err := strconv.ParseUint(n, 10, 32); err != nil {
			return keys, fmt.Errorf("/public-keys/: bad index line %q", line)
		}
		k, err := c.Text(ctx, "/public-keys/"+n)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return keys, err
		}
		if k = strings.TrimSpace(k); k != "" {
			keys = append(keys, k)
		}
	}
	return keys, nil
}

// UserData fetches /user-data. 204 gives ErrNoUserData, 404 ErrNotFound. While the
// IMDS gates it (503) it retries after Retry-After (default 2 s) until wait has
// passed (wait <= 0 asks once), then returns ErrGated wrapped with the IMDS's
// reason. onGated is called on each 503 it waits out (may be nil).
func (c *Client) UserData(ctx context.Context, wait time.Duration, onGated func(reason string, retry time.Duration)) ([]byte, error) {
	deadline := c.now().Add(wait)
	for {
		r, err := c.Get(ctx, "/user-data", http.StatusNoContent, http.StatusServiceUnavailable)
		if err != nil {
			return nil, err
		}
		switch r.Status {
		case http.StatusOK:
			return r.Body, nil
		case http.StatusNoContent:
			return nil, ErrNoUserData
		case http.StatusNotFound:
			return nil, ErrNotFound
		}
		// 503: gated until the initrd-stage attestation verifies.
		reason := Snippet(r.Body)
		d := RetryAfter(r.RetryAfter, 2*time.Second)
		left := deadline.Sub(c.now())
		if wait <= 0 || left <= 0 {
			return nil, fmt.Errorf("%w after %s: %s", ErrGated, wait, reason)
		}
		d = min(d, left)
		if onGated != nil {
			onGated(reason, d)
		}
		if err := c.sleep(ctx, d); err != nil {
			return nil, fmt.Errorf("%w: %v: %s", ErrGated, err, reason)
		}
	}
}

// KubernetesVersion is /kubernetes-version, trimmed; ErrNotFound when the VM
// has none (404).
func (c *Client) KubernetesVersion(ctx context.Context) (string, error) {
	s, err := c.Text(ctx, "/kubernetes-version")
	return strings.TrimSpace(s), err
}

// TooLargeError is a body longer than the caller's bound; nothing past the
// bound was read.
type TooLargeError struct {
	Key string
	Max int64
}

func (e *TooLargeError) Error() string {
	return fmt.Sprintf("GET %s: larger than the %d-byte bound", e.Key, e.Max)
}

// SysupdateFile streams /sysupdate/{component}/{file} into w, at most max
// bytes (a longer body gives *TooLargeError), and returns the bytes written.
// ErrNotFound for a 404. Transport errors and 5xx are retried as Get does,
// but only before the body starts: w never gets a second copy.
func (c *Client) SysupdateFile(ctx context.Context, component, file string, w io.Writer, max int64) (int64, error) {
	for _, s := range []string{component, file} {
		if s == "" || s == "." || s == ".." || strings.ContainsAny(s, "/\\?#%") {
			return 0, fmt.Errorf("sysupdate: bad path element %q", s)
		}
	}
	key := "/sysupdate/" + component + "/" + file
	var n int64
	err := c.retry(ctx, func() (retry bool, err error) {
		var written int64
		written, retry, err = c.stream(ctx, key, w, max)
		if !retry {
			n = written
		}
		return retry, err
	})
	return n, err
}

// stream is one attempt of SysupdateFile; retry says nothing was written and
// another attempt may help.
func (c *Client) stream(ctx context.Context, key string, w io.Writer, max int64) (n int64, retry bool, err error) {
	u := strings.TrimSuffix(c.BaseURL, "/") + key
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, false, err
	}
	// Big files: only the connection and the headers are bounded in time.
	hc := *c.HTTP
	hc.Timeout = 0
	rsp, err := hc.Do(req)
	if err != nil {
		return 0, true, err
	}
	defer rsp.Body.Close()
	switch {
	case rsp.StatusCode == http.StatusNotFound:
		return 0, false, ErrNotFound
	case rsp.StatusCode != http.StatusOK:
		b, _ := io.ReadAll(io.LimitReader(rsp.Body, 4<<10))
		return 0, rsp.StatusCode >= 500, fmt.Errorf("GET %s: %d %s: %s", key, rsp.StatusCode, http.StatusText(rsp.StatusCode), Snippet(b))
	case rsp.ContentLength > max:
		return 0, false, &TooLargeError{Key: key, Max: max}
	}
	n, err = io.Copy(w, io.LimitReader(rsp.Body, max+1))
	if err != nil {
		return n, false, fmt.Errorf("GET %s: %w", key, err)
	}
	if n > max {
		return n, false, &TooLargeError{Key: key, Max: max}
	}
	return n, false, nil
}

// PostReport sends a JSON report to /report once (no retries: reports are sent
// again periodically anyway); the IMDS answers 204.
func (c *Client) PostReport(ctx context.Context, body []byte) error {
	u := strings.TrimSuffix(c.BaseURL, "/") + "/report"
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	rsp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer rsp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(rsp.Body, 4<<10))
	if rsp.StatusCode != http.StatusNoContent {
		return fmt.Errorf("POST /report: %d %s: %s", rsp.StatusCode, http.StatusText(rsp.StatusCode), Snippet(msg))
	}
	return nil
}

// RetryAfter parses a Retry-After value in seconds (HTTP dates are not used by the
// IMDS); def when absent or invalid, at least 100 ms so a 0 does not spin.
func RetryAfter(v string, def time.Duration) time.Duration {
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 0 {
		return def
	}
	return max(time.Duration(n)*time.Second, 100*time.Millisecond)
}

// Snippet is the start of a response body for an error message.
func Snippet(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return s
}
