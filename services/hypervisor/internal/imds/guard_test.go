package imds

import (
	"net/http"
	"testing"
	"time"
)

// A VM over its bucket gets 429 with Retry-After, counted; another VM and
// a caller without a lease are not affected, and tokens come back with time.
func TestRateLimitPerVM(t *testing.T) {
	now := time.Unix(1000, 0)
	g := NewGuard(Limits{RequestsPerSecond: 2, Burst: 3})
	g.now = func() time.Time { return now }
	h := New(newFake(), g, nil)

	for i := range 3 {
		if w := get(t, h, ipFull, "/hostname"); w.Code != 200 {
			t.Fatalf("request %d within the burst: %d", i, w.Code)
		}
	}
	w := get(t, h, ipFull, "/hostname")
	if w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "1" || w.Body.String() != RateLimited {
		t.Fatalf("over the burst: %d %q %q", w.Code, w.Header().Get("Retry-After"), w.Body.String())
	}
	if w := get(t, h, ipFull, "/user-data"); w.Code != http.StatusTooManyRequests {
		t.Errorf("every key shares the bucket: %d", w.Code)
	}
	// Forged headers name no other bucket: identity is the TCP peer.
	if w := do(t, h, ipFull, http.MethodGet, BasePath+"/hostname", nil, "X-Forwarded-For", ipBare); w.Code != http.StatusTooManyRequests {
		t.Errorf("a forged header escaped the limit: %d", w.Code)
	}
	if w := get(t, h, ipBare, "/instance-id"); w.Code != 200 {
		t.Errorf("another VM: %d", w.Code)
	}
	for range 10 {
		if w := get(t, h, ipUnknown, "/hostname"); w.Code != http.StatusForbidden {
			t.Fatalf("no lease: %d", w.Code)
		}
	}
	now = now.Add(500 * time.Millisecond) // one token at 2/s
	if w := get(t, h, ipFull, "/hostname"); w.Code != 200 {
		t.Errorf("after a token came back: %d", w.Code)
	}
	if w := get(t, h, ipFull, "/hostname"); w.Code != http.StatusTooManyRequests {
		t.Errorf("the token was spent: %d", w.Code)
	}
	now = now.Add(time.Hour) // the bucket refills to its burst, no further
	for i := range 4 {
		want := 200
		if i == 3 {
			want = http.StatusTooManyRequests
		}
		if w := get(t, h, ipFull, "/hostname"); w.Code != want {
			t.Errorf("after an hour, request %d: %d, want %d", i, w.Code, want)
		}
	}

	byVM := map[string]uint64{}
	for _, c := range g.Counters() {
		byVM[c.VMID] = c.RateLimited
	}
	if byVM["0a1b2c3d"] != 5 || byVM["deadbeef"] != 0 || len(byVM) != 2 {
		t.Errorf("counters %v", byVM)
	}
	g.Forget("0a1b2c3d")
	if len(g.Counters()) != 1 {
		t.Errorf("a forgotten VM is still counted: %+v", g.Counters())
	}
}

func TestRetryAfterRoundsUp(t *testing.T) {
	now := time.Unix(1000, 0)
	g := NewGuard(Limits{RequestsPerSecond: 0.25, Burst: 1})
	g.now = func() time.Time { return now }
	h := New(newFake(), g, nil)
	get(t, h, ipFull, "/hostname")
	if w := get(t, h, ipFull, "/hostname"); w.Header().Get("Retry-After") != "4" {
		t.Errorf("Retry-After at 0.25/s: %q", w.Header().Get("Retry-After"))
	}
}

func TestGuardDefaults(t *testing.T) {
	l := NewGuard(Limits{}).Limits()
	if l.RequestsPerSecond != DefaultRequestsPerSecond || l.Burst != DefaultBurst || l.MaxQuoteBytes != 1<<20 || l.MaxReportBytes != 2<<20 {
		t.Errorf("defaults %+v", l)
	}
}
