// Package sshexec runs one command in a guest over SSH (contract §7.4): it
// logs in as root with the VM's own key, pins the guest's host key on first
// use, and returns stdout, stderr and the exit code. A non-zero exit is a
// result, not an error.
package sshexec

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/crypto/ssh"
)

// HandshakeTimeout bounds the SSH handshake (contract §7.4).
const HandshakeTimeout = 15 * time.Second

// MaxOutput is how much of stdout and of stderr a result keeps; the rest is
// read and dropped so the command is not blocked on a full pipe.
const MaxOutput = 1 << 20

// ErrHostKeyChanged is returned when the guest presents another host key
// than the one pinned on first use.
var ErrHostKeyChanged = errors.New("host key changed")

// Result is how a command ended.
type Result struct {
	Stdout, Stderr []byte
	ExitCode       int
	// Truncated says stdout or stderr went over MaxOutput.
	Truncated bool
}

// NewKey makes a per-VM ed25519 key: the private key in OpenSSH PEM and
// the public key as one authorized_keys line ending in comment.
func NewKey(comment string) (privatePEM []byte, authorizedKey string, err error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, "", err
	}
	block, err := ssh.MarshalPrivateKey(priv, comment)
	if err != nil {
		return nil, "", err
	}
	sp, err := ssh.NewPublicKey(pub)
	if err != nil {
		return nil, "", err
	}
	line := strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sp)))
	if comment != "" {
		line += " " + comment
	}
	return pem.EncodeToMemory(block), line, nil
}

// Quote single-quotes every word so the guest's shell runs argv as given
// (contract §7.4: "each command word is single-quoted").
func Quote(argv []string) string {
	words := make([]string, len(argv))
	for i, w := range argv {
		words[i] = "'" + strings.ReplaceAll(w, "'", `'\''`) + "'"
	}
	return strings.Join(words, " ")
}

// PinFile keeps the guest's host key in one file (authorized_keys format).
type PinFile string

// callback accepts the pinned key, or pins the first key seen. Of
// concurrent first connections one pins its key, the others are checked
// against it.
func (p PinFile) callback() ssh.HostKeyCallback {
	return func(_ string, _ net.Addr, key ssh.PublicKey) error {
		b, err := os.ReadFile(string(p))
		if errors.Is(err, os.ErrNotExist) {
			if err = pinFirst(string(p), ssh.MarshalAuthorizedKey(key)); !errors.Is(err, os.ErrExist) {
				return err
			}
			b, err = os.ReadFile(string(p))
		}
		if err != nil {
			return fmt.Errorf("read pinned host key: %w", err)
		}
		pinned, _, _, _, err := ssh.ParseAuthorizedKey(b)
		if err != nil {
			return fmt.Errorf("parse pinned host key %s: %w", p, err)
		}
		if !bytes.Equal(pinned.Marshal(), key.Marshal()) {
			return fmt.Errorf("%w: pinned %s, offered %s", ErrHostKeyChanged, ssh.FingerprintSHA256(pinned), ssh.FingerprintSHA256(key))
		}
		return nil
	}
}

// Run logs in as root over conn (which it closes) and runs argv.
func Run(ctx context.Context, conn net.Conn, keyPEM []byte, pin PinFile, argv []string) (*Result, error) {
	defer conn.Close()
	if len(argv) == 0 {
		return nil, errors.New("empty command")
	}
	// Closing conn is how a cancelled context ends a stuck handshake or command.
	client, stop, err := handshake(ctx, conn, keyPEM, pin)
	if err != nil {
		return nil, err
	}
	defer stop()
	defer client.Close()
	sess, err := client.NewSession()
	if err != nil {
		return nil, fmt.Errorf("ssh session: %w", err)
	}
	defer sess.Close()
	stdout, stderr := &capped{max: MaxOutput}, &capped{max: MaxOutput}
	sess.Stdout, sess.Stderr = stdout, stderr
	err = sess.Run(Quote(argv))
	res := &Result{Stdout: stdout.buf.Bytes(), Stderr: stderr.buf.Bytes(), Truncated: stdout.over || stderr.over}
	var exit *ssh.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		res.ExitCode = exit.ExitStatus()
		if exit.Signal() != "" && res.ExitCode == 0 {
			res.ExitCode = 128 + signalNumber(exit.Signal())
		}
	case ctx.Err() != nil:
		return nil, ctx.Err()
	default:
		return nil, fmt.Errorf("ssh run: %w", err)
	}
	return res, nil
}

// signalNumber maps the SSH signal names to Linux numbers, as a shell reports
// a killed child (128+n).
func signalNumber(name string) int {
	switch name {
	case "HUP":
		return 1
	case "INT":
		return 2
	case "QUIT":
		return 3
	case "ABRT":
		return 6
	case "KILL":
		return 9
	case "SEGV":
		return 11
	case "PIPE":
		return 13
	case "ALRM":
		return 14
	case "TERM":
		return 15
	}
	return 0
}

type capped struct {
	buf  bytes.Buffer
	max  int
	over bool
}

func (c *capped) Write(b []byte) (int, error) {
	if room := c.max - c.buf.Len(); room < len(b) {
		c.over = true
		c.buf.Write(b[:max(room, 0)])
		return len(b), nil
	}
	return c.buf.Write(b)
}

// pinFirst creates path with data unless it exists (an error satisfying
// errors.Is(err, os.ErrExist)); the file appears complete or not at all.
func pinFirst(path string, data []byte) error {
	tmp, err := syncedTemp(path, data)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	return os.Link(tmp, path)
}

// writeAtomic replaces path with data; the file appears complete or not at all.
func writeAtomic(path string, data []byte) error {
	tmp, err := syncedTemp(path, data)
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// syncedTemp writes data to a new 0600 file beside path and syncs it.
func syncedTemp(path string, data []byte) (string, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return "", err
	}
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp-*")
	if err != nil {
		return "", err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return "", err
	}
	return f.Name(), nil
}

// WriteKey stores a private key with the same crash safety as the pin.
func WriteKey(path string, privatePEM []byte) error { return writeAtomic(path, privatePEM) }
