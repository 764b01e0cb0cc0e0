// Package notify receives readiness messages (sd_notify text: newline-separated
// KEY=VALUE, "READY=1", "STATUS=...") from guests and routes them to the
// subscriber of each VM. Two transports feed one Router: a virtio-serial port
// bridged to a per-VM unix socket (AttachSerial), and one AF_VSOCK listener
// for all VMs (ServeVsock).
package notify

import (
	"bytes"
	"fmt"
)

// MaxMessage is the largest message accepted, in bytes.
const MaxMessage = 64 << 10

// Message is one parsed notification.
type Message struct {
	Ready  bool   // READY=1
	Status string // STATUS=
	// Fields holds every KEY=VALUE, READY and STATUS included; a repeated
	// key keeps its last value.
	Fields map[string]string
	// Privileged: sent by the guest's PID 1. Over vsock that is a source
	// port below 1024; a virtio-serial port is the guest's own device and
	// always counts as privileged.
	Privileged bool
}

// Delivery is a message attributed to a VM by a transport.
type Delivery struct {
	VM  string
	Msg Message
}

// Parse reads sd_notify text. Empty lines are ignored; a line without '='
// or with an empty key is an error.
func Parse(b []byte) (Message, error) {
	if len(b) > MaxMessage {
		return Message{}, fmt.Errorf("notify message of %d bytes exceeds %d", len(b), MaxMessage)
	}
	m := Message{Fields: map[string]string{}}
	for n, line := range bytes.Split(b, []byte{'\n'}) {
		if len(line) == 0 {
			continue
		}
		k, v, ok := bytes.Cut(line, []byte{'='})
		if !ok || len(k) == 0 {
			return Message{}, fmt.Errorf("notify message line %d: %q is not KEY=VALUE", n+1, truncate(line))
		}
		m.Fields[string(k)] = string(v)
	}
	m.Ready = m.Fields["READY"] == "1"
	m.Status = m.Fields["STATUS"]
	return m, nil
}

func truncate(b []byte) []byte {
	if len(b) > 64 {
		return b[:64]
	}
	return b
}
