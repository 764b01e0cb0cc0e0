package swtpm

import (
	"bytes"
	"crypto/sha256"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
)

// A boot's PCRs stay readable after its data channel closed, with Linger;
// without it, swtpm ends with the channel (--terminate), as QEMU needs.
func TestReadPCRsAfterTheBoot(t *testing.T) {
	needSwtpm(t)
	for _, linger := range []bool{true, false} {
		cfg := Config{StateDir: filepath.Join(shortDir(t), "tpm"), Linger: linger}.WithDefaults()
		p, err := Start(ctxT(t, 10*time.Second), cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Terminate(StopGrace)

		// The "boot": a channel like QEMU's, TPM2_Startup, one extend, closed.
		tpm, err := DataChannel(ctxT(t, 10*time.Second), cfg.CtrlSocket)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := (tpm2.Startup{StartupType: tpm2.TPMSUClear}).Execute(tpm); err != nil {
			t.Fatalf("TPM2_Startup: %v", err)
		}
		word := sha256.Sum256([]byte("measured"))
		ext := tpm2.PCRExtend{
			PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(4), Auth: tpm2.PasswordAuth(nil)},
			Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: word[:]}}},
		}
		if _, err := ext.Execute(tpm); err != nil {
			t.Fatalf("TPM2_PCR_Extend: %v", err)
		}
		tpm.Close()

		if !linger {
			select {
			case <-p.Done():
			case <-time.After(5 * time.Second):
				t.Fatal("swtpm without Linger still runs after its data channel closed")
			}
			continue
		}
		// swtpm polls its data and control channels together: once it has
		// answered on a control connection opened after the close, it has
		// seen the data channel's hangup, which ends it without Linger.
		got, err := ReadPCRs(ctxT(t, 10*time.Second), cfg.CtrlSocket, []uint{0, 1, 2, 3, 4, 5, 6, 7, 9, 12})
		if err != nil {
			t.Fatalf("swtpm with Linger, after its data channel closed: %v", err)
		}
		if p.Exited() {
			t.Fatal("swtpm with Linger ended with its data channel")
		}
		want := sha256.Sum256(append(make([]byte, 32), word[:]...))
		if !bytes.Equal(got[4], want[:]) {
			t.Errorf("pcr 4 = %x, want the extend's %x", got[4], want)
		}
		if !bytes.Equal(got[12], make([]byte, 32)) || len(got) != 10 {
			t.Errorf("read %d pcrs, pcr 12 = %x; want 10, and 12 untouched", len(got), got[12])
		}
	}
}
