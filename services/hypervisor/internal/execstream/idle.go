package execstream

import (
	"sync/atomic"
	"time"
)

// idleTimer fires once no touch came for its timeout. Touches only record
// the time, so the output path pays an atomic store per chunk, no timer reset.
type idleTimer struct {
	timeout time.Duration
	last    atomic.Int64 // unix nanoseconds of the last touch
	t       *time.Timer
}

func newIdle(timeout time.Duration, fire func()) *idleTimer {
	it := &idleTimer{timeout: timeout}
	it.touch()
	var check func()
	check = func() {
		if left := it.timeout - time.Since(time.Unix(0, it.last.Load())); left > 0 {
			it.t.Reset(left)
			return
		}
		fire()
	}
	it.t = time.AfterFunc(timeout, check)
	return it
}

func (it *idleTimer) touch() { it.last.Store(time.Now().UnixNano()) }

func (it *idleTimer) stop() { it.t.Stop() }
