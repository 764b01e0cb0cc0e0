// Package agent is vm-agent's PID 1 flow for the project's test guest.
package agent

import (
	"fmt"
	"io"
	"strings"
	"sync"
)

// Prefix starts every console line, so host tests can pick them out of kernel output.
const Prefix = "vm-agent: "

// Console writes prefixed progress lines.
type Console struct {
	mu sync.Mutex
	w  io.Writer
}

func NewConsole(w io.Writer) *Console { return &Console{w: w} }

// Printf writes one line; a message with several lines gets the prefix on each.
func (c *Console) Printf(format string, args ...any) {
	msg := strings.TrimRight(fmt.Sprintf(format, args...), "\n")
	var b strings.Builder
	for _, line := range strings.Split(msg, "\n") {
		b.WriteString(Prefix)
		b.WriteString(line)
		b.WriteString("\n")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	_, _ = io.WriteString(c.w, b.String())
}

// Line writes one line as it is, without Prefix: a workload's output,
// which carries its own (ocirun.EntrypointPrefix).
func (c *Console) Line(s string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, _ = io.WriteString(c.w, s+"\n")
}
