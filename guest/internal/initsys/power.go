package initsys

import (
	"context"
	"encoding/binary"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Linux input event constants (linux/input-event-codes.h).
const (
	EvKey    = 0x01
	KeyPower = 116
)

// inputEventSize is sizeof(struct input_event) on 64-bit: timeval (16), type, code
// (2 each), value (4).
const inputEventSize = 24

// InputEvent is the part of struct input_event that matters here.
type InputEvent struct {
	Type, Code uint16
	Value      int32
}

// ParseInputEvents decodes whole events from b (little-endian, 64-bit layout).
func ParseInputEvents(b []byte) []InputEvent {
	var evs []InputEvent
	for ; len(b) >= inputEventSize; b = b[inputEventSize:] {
		evs = append(evs, InputEvent{
			Type:  binary.LittleEndian.Uint16(b[16:]),
			Code:  binary.LittleEndian.Uint16(b[18:]),
			Value: int32(binary.LittleEndian.Uint32(b[20:])),
		})
	}
	return evs
}

// IsPowerPress reports a KEY_POWER key-down event.
func IsPowerPress(e InputEvent) bool { return e.Type == EvKey && e.Code == KeyPower && e.Value == 1 }

// WatchPowerButton calls pressed once when any /dev/input/event* device reports
// KEY_POWER down (the ACPI button driver's input device does on system_powerdown).
// It rescans for new devices every rescan interval until ctx ends.
func WatchPowerButton(ctx context.Context, glob string, rescan time.Duration, pressed func(dev string)) {
	var once sync.Once
	watching := map[string]bool{}
	for {
		paths, _ := filepath.Glob(glob)
		for _, p := range paths {
			if watching[p] {
				continue
			}
			f, err := os.Open(p)
			if err != nil {
				continue
			}
			watching[p] = true
			go func() {
				defer f.Close()
				if watchDevice(f) {
					once.Do(func() { pressed(p) })
				}
			}()
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(rescan):
		}
	}
}

// watchDevice reads events until a power press (true) or a read error (false).
func watchDevice(r io.Reader) bool {
	buf := make([]byte, 64*inputEventSize)
	for {
		n, err := io.ReadAtLeast(r, buf, inputEventSize)
		// The kernel returns whole events, so n is a multiple of the event size.
		for _, e := range ParseInputEvents(buf[:n]) {
			if IsPowerPress(e) {
				return true
			}
		}
		if err != nil {
			return false
		}
	}
}

// PowerOff syncs and powers the machine off. It returns only if the reboot syscall
// fails (not PID 1, no CAP_SYS_BOOT).
func PowerOff() error {
	unix.Sync()
	return unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
}

// Reset syncs and restarts the machine (reboot(2) RESTART). It returns only
// if the reboot syscall fails.
func Reset() error {
	unix.Sync()
	return unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
}

// CtrlAltDelToSignal makes the kernel send SIGINT to PID 1 on Ctrl-Alt-Del instead of
// rebooting at once, so it takes the same clean power-off path.
func CtrlAltDelToSignal() error { return unix.Reboot(unix.LINUX_REBOOT_CMD_CAD_OFF) }

// TermSignals returns a channel that receives SIGTERM and SIGINT. PID 1 gets signals
// only for which it has installed a handler, which signal.Notify does.
func TermSignals() <-chan os.Signal {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, unix.SIGTERM, unix.SIGINT)
	return ch
}
