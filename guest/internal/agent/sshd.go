package agent

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"io/fs"
	"net"
	"os"
	"os/exec"

	"golang.org/x/crypto/ssh"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/hostkey"
	"github.com/giantswarm/vm-manager/guest/internal/initsys"
	"github.com/giantswarm/vm-manager/guest/internal/sshd"
)

// SSHAddr is where the host reaches the guest's SSH server.
const SSHAddr = "0.0.0.0:22"

// tpmPaths are tried in order for the host key; without a resource manager
// (/dev/tpm0) the device takes one open at a time, so it is closed again at once.
var tpmPaths = []string{attest.DefaultTPMPath, "/dev/tpm0"}

// startSSHD serves SSH for the host, which runs commands as root with its per-VM
// key (public key 0, written to authorized_keys by provisioning, maybe later than
// this: the server reads the file on each login). command, when not nil, builds
// the commands (inside a booted OCI image's root).
func startSSHD(con *Console, command func(context.Context, []string, []string) (*exec.Cmd, error)) *sshd.Server {
	signer, err := ssh.NewSignerFromKey(loadHostKey(con))
	if err != nil {
		con.Printf("warning: sshd: %v", err)
		return nil
	}
	ln, err := net.Listen("tcp", SSHAddr)
	if err != nil {
		con.Printf("warning: sshd: %v", err)
		return nil
	}
	srv := sshd.New(signer, AuthorizedKeysPath, func(format string, args ...any) {
		con.Printf("sshd: "+format, args...)
	})
	srv.StartCmd = initsys.StartCmd // PID 1 reaps zombies: it must spare sshd's children
	srv.Command = command
	con.Printf("sshd: listening on :22, host key %s", ssh.FingerprintSHA256(signer.PublicKey()))
	go func() {
		if err := srv.Serve(ln); err != nil {
			con.Printf("warning: sshd stopped: %v", err)
		}
	}()
	return srv
}

// loadHostKey returns the host key kept in the vTPM, so the host's pinned key stays
// valid across reboots; without a TPM a random key that lasts this boot only.
func loadHostKey(con *Console) ed25519.PrivateKey {
	for _, path := range tpmPaths {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			con.Printf("warning: sshd host key: %v", err)
			break
		}
		key, created, err := hostkey.LoadOrCreate(f)
		f.Close() // before attestation opens the TPM
		if err != nil {
			con.Printf("warning: sshd host key: %s: %v", path, err)
			break
		}
		if created {
			con.Printf("sshd: new host key, seed stored in TPM NV index %#x", uint32(hostkey.NVIndex))
		}
		return key
	}
	con.Printf("warning: sshd: no TPM host key; using a random one that changes with every boot")
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return key
}
