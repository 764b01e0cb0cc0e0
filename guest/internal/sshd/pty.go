package sshd

import (
	"fmt"
	"os"
	"strings"

	"golang.org/x/crypto/ssh"
	"golang.org/x/sys/unix"
)

// MaxTermSize bounds a pty's rows and columns: the kernel keeps them as
// uint16, and a client's nonsense must not wrap around.
const MaxTermSize = 10000

// ptyReq is an SSH "pty-req" payload (RFC 4254 §6.2); the terminal modes are
// accepted and ignored: the kernel's defaults are a sane terminal.
type ptyReq struct {
	Term          string
	Cols, Rows    uint32
	Width, Height uint32
	Modes         string
}

// winChange is a "window-change" payload (RFC 4254 §6.7).
type winChange struct {
	Cols, Rows    uint32
	Width, Height uint32
}

// validTerm keeps TERM to what terminfo names look like.
func validTerm(t string) bool {
	return len(t) <= 64 && strings.Trim(t, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.+-_") == ""
}

// openPTY allocates a pseudo-terminal: the master, and its peer for the child.
func openPTY() (master, peer *os.File, err error) {
	fd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("open /dev/ptmx: %w", err)
	}
	// Non-blocking, so the runtime poller serves reads and Close ends one.
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, nil, err
	}
	master = os.NewFile(uintptr(fd), "/dev/ptmx")
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		master.Close()
		return nil, nil, fmt.Errorf("unlock pty: %w", err)
	}
	n, err := unix.IoctlGetUint32(fd, unix.TIOCGPTN)
	if err != nil {
		master.Close()
		return nil, nil, fmt.Errorf("pty number: %w", err)
	}
	peer, err = os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		master.Close()
		return nil, nil, err
	}
	return master, peer, nil
}

// setSize sets a pty's window size; the kernel sends SIGWINCH to its
// foreground process group.
func setSize(master *os.File, rows, cols uint32) error {
	ws := &unix.Winsize{Row: uint16(min(rows, MaxTermSize)), Col: uint16(min(cols, MaxTermSize))}
	return unix.IoctlSetWinsize(int(master.Fd()), unix.TIOCSWINSZ, ws)
}

// signalNum maps an SSH signal name ("INT", RFC 4254 §6.10) to its number.
func signalNum(name string) (unix.Signal, bool) {
	if name == "" || strings.HasPrefix(name, "SIG") {
		return 0, false
	}
	s := unix.SignalNum("SIG" + name)
	return s, s != 0
}

func parsePtyReq(payload []byte) (*ptyReq, bool) {
	var p ptyReq
	if ssh.Unmarshal(payload, &p) != nil || !validTerm(p.Term) {
		return nil, false
	}
	return &p, true
}
