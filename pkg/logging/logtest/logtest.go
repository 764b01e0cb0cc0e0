// Package logtest holds what tests of the services' logging share.
package logtest

import (
	"bytes"
	"sync"
)

// Buffer collects log output written from several goroutines (a server's
// handlers, a refresh loop) for a test to read.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
