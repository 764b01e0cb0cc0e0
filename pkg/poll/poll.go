// Package poll is for tests that wait for a state instead of sleeping: Until
// checks a condition every few milliseconds and fails the test after a bound.
package poll

import (
	"testing"
	"time"
)

// Bound is how long Until waits: long enough for a loaded 2-core machine.
const Bound = 10 * time.Second

// Until polls cond until it holds, failing t with what after Bound.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(Bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", Bound, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
