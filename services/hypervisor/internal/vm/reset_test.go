package vm

import (
	"testing"
	"time"
)

func TestNoteResetCountsWithinTheWindow(t *testing.T) {
	mc := &machine{}
	start := time.Now()
	for i := 1; i <= MaxGuestResets+1; i++ {
		if n := mc.noteReset(start.Add(time.Duration(i) * time.Second)); n != i {
			t.Fatalf("reset %d counted as %d", i, n)
		}
	}
	// Once the window has passed, only the new reset counts.
	if n := mc.noteReset(start.Add(GuestResetWindow + time.Minute)); n != 1 {
		t.Errorf("after the window: %d", n)
	}
}
