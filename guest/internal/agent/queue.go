package agent

import (
	"strings"
	"sync"

	"github.com/giantswarm/vm-manager/guest/internal/sdnotify"
)

// queue decouples boot from readiness delivery: the transport is known only after the
// modules are loaded, and a virtio-serial write blocks until the host connects.
type queue struct {
	ch    chan string
	con   *Console
	ready chan struct{} // closed once READY=1 reached the host
	once  sync.Once
}

func newQueue(con *Console) *queue {
	return &queue{ch: make(chan string, 64), con: con, ready: make(chan struct{})}
}

// Send enqueues without blocking; a full queue drops, which only loses STATUS noise
// unless the host never connects.
func (q *queue) Send(assignments ...string) {
	msg, err := sdnotify.Message(assignments...)
	if err != nil {
		q.con.Printf("notify: %v", err)
		return
	}
	select {
	case q.ch <- msg:
	default:
		q.con.Printf("notify: queue full, dropped %q", msg)
	}
}

// run picks the transport once, then delivers queued messages in order.
func (q *queue) run(pick func() (sdnotify.Sender, error)) {
	s, err := pick()
	if err != nil {
		q.con.Printf("readiness cannot be reported: %v", err)
		for range q.ch {
		}
		return
	}
	q.con.Printf("notify via %s", s)
	for msg := range q.ch {
		if err := s.Send(msg); err != nil {
			q.con.Printf("notify via %s: %v", s, err)
			continue
		}
		if strings.Contains("\n"+msg+"\n", "\nREADY=1\n") {
			q.con.Printf("READY=1 delivered")
			q.once.Do(func() { close(q.ready) })
		}
	}
}
