// Package sdnotify is the guest (client) side of readiness reporting with sd_notify
// semantics: newline-separated KEY=VALUE messages such as "STATUS=…" and "READY=1".
//
// Two transports exist. A virtio-serial port named PortName carries a byte stream on
// which every message is terminated by a single NUL byte. An AF_VSOCK stream address
// (the vmm.notify_socket credential, "vsock-stream:2:<port>") carries one message per
// connection, unframed, as systemd does.
package sdnotify

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"
)

// PortName is the virtio-serial port name the host exposes for notifications.
const PortName = "org.giantswarm.vmm.notify"

// Terminator ends every message on the virtio-serial stream.
const Terminator = 0

// MaxMessage matches the host's per-message limit.
const MaxMessage = 64 << 10

// ErrNoTransport means neither the virtio-serial port nor a vsock address exists.
var ErrNoTransport = errors.New("notify: no virtio-serial port " + PortName + " and no vmm.notify_socket credential")

// Message joins KEY=VALUE assignments into one sd_notify message.
func Message(assignments ...string) (string, error) {
	if len(assignments) == 0 {
		return "", errors.New("notify: empty message")
	}
	for _, a := range assignments {
		k, _, ok := strings.Cut(a, "=")
		if !ok || k == "" {
			return "", fmt.Errorf("notify: %q is not KEY=VALUE", a)
		}
		if strings.ContainsAny(a, "\n\x00") {
			return "", fmt.Errorf("notify: %q contains a newline or NUL", a)
		}
	}
	msg := strings.Join(assignments, "\n")
	if len(msg) > MaxMessage {
		return "", fmt.Errorf("notify: message of %d bytes exceeds %d", len(msg), MaxMessage)
	}
	return msg, nil
}

// Frame returns msg as written on the virtio-serial stream: the message and one NUL.
func Frame(msg string) ([]byte, error) {
	if strings.IndexByte(msg, Terminator) >= 0 {
		return nil, errors.New("notify: message contains NUL")
	}
	if len(msg) > MaxMessage {
		return nil, fmt.Errorf("notify: message of %d bytes exceeds %d", len(msg), MaxMessage)
	}
	b := make([]byte, 0, len(msg)+1)
	b = append(b, msg...)
	return append(b, Terminator), nil
}

// ScanFrames is a bufio.SplitFunc that yields NUL-terminated messages without the NUL.
// A trailing unterminated fragment at EOF is dropped: the writer did not finish it.
func ScanFrames(data []byte, atEOF bool) (advance int, token []byte, err error) {
	if i := bytes.IndexByte(data, Terminator); i >= 0 {
		return i + 1, data[:i], nil
	}
	if atEOF {
		return len(data), nil, nil
	}
	if len(data) > MaxMessage {
		return 0, nil, bufio.ErrTooLong
	}
	return 0, nil, nil
}

// Sender delivers one message.
type Sender interface {
	Send(msg string) error
	Close() error
	String() string
}

// Serial writes framed messages to a virtio-serial port device. A write blocks until
// the host side of the port is connected, so callers send from a goroutine.
type Serial struct {
	mu   sync.Mutex
	path string
	f    *os.File
}

// OpenSerial opens the port device, e.g. /dev/vport1p1, for both ways: the
// host sends messages too (Receive).
func OpenSerial(path string) (*Serial, error) {
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, err
	}
	return &Serial{path: path, f: f}, nil
}

// Send writes msg and its terminator in a single write, so frames never interleave.
func (s *Serial) Send(msg string) error {
	b, err := Frame(msg)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	_, err = s.f.Write(b)
	return err
}

// Receive calls fn with each message the host writes to the port, until a
// read fails. A read returns EOF while the host side is not connected (the
// hypervisor restarts, a fork's is not attached yet): it reads again after
// idle. A message over MaxMessage is an error.
func (s *Serial) Receive(fn func(msg string), idle time.Duration) error {
	for {
		sc := bufio.NewScanner(s.f)
		sc.Buffer(make([]byte, 4096), MaxMessage+1)
		sc.Split(ScanFrames)
		for sc.Scan() {
			fn(sc.Text())
		}
		if err := sc.Err(); err != nil {
			return err
		}
		time.Sleep(idle)
	}
}

func (s *Serial) Close() error   { return s.f.Close() }
func (s *Serial) String() string { return "virtio-serial " + s.path }

// Address is an AF_VSOCK stream address.
type Address struct {
	CID, Port uint32
}

// ParseAddress parses "vsock-stream:<cid>:<port>" (or systemd's "vsock:<cid>:<port>").
func ParseAddress(s string) (Address, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 || (parts[0] != "vsock-stream" && parts[0] != "vsock") {
		return Address{}, fmt.Errorf("notify: %q is not vsock-stream:<cid>:<port>", s)
	}
	cid, err := strconv.ParseUint(parts[1], 10, 32)
	if err != nil {
		return Address{}, fmt.Errorf("notify: cid in %q: %w", s, err)
	}
	port, err := strconv.ParseUint(parts[2], 10, 32)
	if err != nil {
		return Address{}, fmt.Errorf("notify: port in %q: %w", s, err)
	}
	return Address{CID: uint32(cid), Port: uint32(port)}, nil
}

func (a Address) String() string { return fmt.Sprintf("vsock-stream:%d:%d", a.CID, a.Port) }

// Vsock sends every message on its own stream connection, then closes it: the host
// reads until EOF.
type Vsock struct {
	Addr    Address
	Timeout time.Duration
	// Dial is replaced in tests; nil means AF_VSOCK.
	Dial func(ctx context.Context, a Address) (net.Conn, error)
}

func (v *Vsock) Send(msg string) error {
	if strings.IndexByte(msg, 0) >= 0 || len(msg) > MaxMessage {
		return errors.New("notify: message contains NUL or is too long")
	}
	timeout := v.Timeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	dial := v.Dial
	if dial == nil {
		dial = dialVsock
	}
	c, err := dial(ctx, v.Addr)
	if err != nil {
		return err // names the address already
	}
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte(msg)); err != nil {
		c.Close()
		return err
	}
	return c.Close()
}

func (v *Vsock) Close() error   { return nil }
func (v *Vsock) String() string { return v.Addr.String() }

func dialVsock(ctx context.Context, a Address) (net.Conn, error) {
	return vsock.DialContext(ctx, a.CID, a.Port, nil)
}

// Paths locates sysfs and /dev; tests point them at a temporary tree.
type Paths struct {
	SysClass string // /sys/class/virtio-ports
	Dev      string // /dev
}

// DefaultPaths are the real locations.
var DefaultPaths = Paths{SysClass: "/sys/class/virtio-ports", Dev: "/dev"}

// ErrNoPort means no virtio-serial port has the requested name (yet).
var ErrNoPort = errors.New("notify: virtio-serial port not found")

// FindPort returns the device path of the virtio-serial port called name. Without
// udev nobody creates the node, so it is made from the port's dev file (major:minor)
// when devtmpfs has not done so already.
func FindPort(p Paths, name string) (string, error) {
	dirs, err := os.ReadDir(p.SysClass)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", ErrNoPort
		}
		return "", err
	}
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(p.SysClass, d.Name(), "name"))
		if err != nil || strings.TrimRight(string(b), "\n") != name {
			continue
		}
		dev := filepath.Join(p.Dev, d.Name())
		if _, err := os.Stat(dev); err == nil {
			return dev, nil
		}
		num, err := os.ReadFile(filepath.Join(p.SysClass, d.Name(), "dev"))
		if err != nil {
			return "", err
		}
		major, minor, err := ParseDevNumber(string(num))
		if err != nil {
			return "", err
		}
		if err := unix.Mknod(dev, unix.S_IFCHR|0o600, int(unix.Mkdev(major, minor))); err != nil && !errors.Is(err, unix.EEXIST) {
			return "", fmt.Errorf("notify: mknod %s: %w", dev, err)
		}
		return dev, nil
	}
	return "", ErrNoPort
}

// WaitPort polls FindPort until the port shows up or ctx ends: ports and their names
// arrive over the virtio-serial control queue after the driver has bound.
func WaitPort(ctx context.Context, p Paths, name string) (string, error) {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		dev, err := FindPort(p, name)
		if !errors.Is(err, ErrNoPort) {
			return dev, err
		}
		select {
		case <-ctx.Done():
			return "", ErrNoPort
		case <-t.C:
		}
	}
}

// ParseDevNumber parses a sysfs dev file ("252:1\n").
func ParseDevNumber(s string) (major, minor uint32, err error) {
	a, b, ok := strings.Cut(strings.TrimSpace(s), ":")
	if !ok {
		return 0, 0, fmt.Errorf("notify: bad dev number %q", s)
	}
	ma, err1 := strconv.ParseUint(a, 10, 32)
	mi, err2 := strconv.ParseUint(b, 10, 32)
	if err1 != nil || err2 != nil {
		return 0, 0, fmt.Errorf("notify: bad dev number %q", s)
	}
	return uint32(ma), uint32(mi), nil
}

// Select picks the transport: the virtio-serial port when present (waiting up to
// portWait for it to appear), else the vsock address socket (may be empty).
func Select(ctx context.Context, p Paths, portWait time.Duration, socket string) (Sender, error) {
	wctx, cancel := context.WithTimeout(ctx, portWait)
	defer cancel()
	dev, err := WaitPort(wctx, p, PortName)
	switch {
	case err == nil:
		return OpenSerial(dev)
	case !errors.Is(err, ErrNoPort):
		return nil, err
	}
	if socket == "" {
		return nil, ErrNoTransport
	}
	a, err := ParseAddress(socket)
	if err != nil {
		return nil, err
	}
	return &Vsock{Addr: a}, nil
}
