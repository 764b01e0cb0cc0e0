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
	UntilWithin(t, Bound, what, cond)
}

// UntilWithin is Until with its own bound, for states that take longer
// than Bound to come (a guest's console after a boot under TCG).
func UntilWithin(t testing.TB, bound time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", bound, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
