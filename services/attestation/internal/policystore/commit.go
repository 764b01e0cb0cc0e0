package policystore

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"
)

// maxGroup bounds the writes one commit carries, so one transaction's dirty
// pages stay small however many callers queue.
const maxGroup = 256

// maxGather bounds how long a commit waits for announced writes: the
// latency a verdict may pay for sharing its commit.
const maxGather = time.Millisecond

// errClosed answers writes queued after Close.
var errClosed = errors.New("attestation store is closed")

// committer is group commit for VM records: a bbolt commit costs two
// fdatasyncs (milliseconds on a real disk) whatever it carries, so the
// writes that arrive while one commit runs go together in the next. A write
// returns after the commit that holds it is on disk, so a verdict its caller
// saw survives a crash. Unlike bbolt's db.Batch it never waits for company:
// a lone caller commits at once and pays what it did before.
type committer struct {
	db *bolt.DB
	in chan *write
	// closing is held shared by senders and exclusively by close, so no
	// write is queued after the loop has drained the channel.
	closing sync.RWMutex
	closed  bool
	done    chan struct{} // closed by close: the loop drains and exits
	stopped chan struct{} // closed by the loop on exit
	// groups and writes count commits and the writes they carried, for the
	// bench and the tests (writes/groups is the mean group size).
	mu             sync.Mutex
	groups, writes uint64
	// announced counts the callers that said a write is coming (Announce)
	// and have not finished.
	announced atomic.Int64
}

type write struct {
	fn  func(*bolt.Tx) error
	err chan error
}

func newCommitter(db *bolt.DB) *committer {
	c := &committer{db: db, in: make(chan *write, maxGroup), done: make(chan struct{}), stopped: make(chan struct{})}
	go c.run()
	return c
}

// update runs fn in a transaction that is on disk when it returns. fn may
// share the transaction with other callers' writes and runs again on its own
// if one of them fails, so it must only write.
func (c *committer) update(fn func(*bolt.Tx) error) error {
	w := &write{fn: fn, err: make(chan error, 1)}
	c.closing.RLock()
	if c.closed {
		c.closing.RUnlock()
		return errClosed
	}
	c.in <- w
	c.closing.RUnlock()
	return <-w.err
}

func (c *committer) run() {
	defer close(c.stopped)
	for {
		var first *write
		select {
		case first = <-c.in:
		case <-c.done:
			c.drain()
			return
		}
		group := c.gather([]*write{first})
		c.commit(group)
	}
}

// gather adds the queued writes to group and, while announced writers are
// still on their way (verifying a quote on the one core the group's callers
// share), waits up to maxGather for them: a commit's fdatasyncs cost CPU
// too (a few hundred µs on a virtual disk), and a group of one write per
// commit spent more on them than on the quotes. A lone caller never waits:
// it is the only one announced.
func (c *committer) gather(group []*write) []*write {
	// The write that woke this loop puts it first in line for the core: let
	// the callers already runnable (with GOMAXPROCS=1, all of them wait for
	// it) get as far as their own writes first.
	runtime.Gosched()
	var timeout <-chan time.Time
	for len(group) < maxGroup {
		select {
		case w := <-c.in:
			group = append(group, w)
			continue
		default:
		}
		if int(c.announced.Load()) <= len(group) {
			return group
		}
		if timeout == nil {
			t := time.NewTimer(maxGather)
			defer t.Stop()
			timeout = t.C
		}
		select {
		case w := <-c.in:
			group = append(group, w)
		case <-timeout:
			return group
		case <-c.done:
			return group
		}
	}
	return group
}

// drain fails what was queued when Close came.
func (c *committer) drain() {
	for {
		select {
		case w := <-c.in:
			w.err <- errClosed
		default:
			return
		}
	}
}

// commit writes a group in one transaction. A failing write rolls the group
// back; then each runs alone, so only it fails.
func (c *committer) commit(group []*write) {
	err := c.db.Update(func(tx *bolt.Tx) error {
		for _, w := range group {
			if err := w.fn(tx); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil && len(group) > 1 {
		for _, w := range group {
			c.commit([]*write{w})
		}
		return
	}
	c.mu.Lock()
	c.groups++
	c.writes += uint64(len(group))
	c.mu.Unlock()
	for _, w := range group {
		w.err <- err
	}
}

// close stops taking writes and returns when the loop has ended; writes
// still queued fail with errClosed.
func (c *committer) close() {
	c.closing.Lock()
	if !c.closed {
		c.closed = true
		close(c.done)
	}
	c.closing.Unlock()
	<-c.stopped
}

// CommitStats are the group commits of VM records so far.
type CommitStats struct{ Commits, Writes uint64 }

// CommitStats returns how many commits carried how many VM writes.
func (s *Store) CommitStats() CommitStats {
	s.vmw.mu.Lock()
	defer s.vmw.mu.Unlock()
	return CommitStats{Commits: s.vmw.groups, Writes: s.vmw.writes}
}

// Announce says a VM write (PutVM) is probably coming from this caller, so a
// commit about to start waits a little for it (see gather). The returned
// func withdraws it: the caller calls it right before its PutVM, or when it
// will not write; more calls do nothing.
func (s *Store) Announce() (done func()) {
	s.vmw.announced.Add(1)
	var once sync.Once
	return func() { once.Do(func() { s.vmw.announced.Add(-1) }) }
}
