package hostkey

import (
	"bytes"
	"errors"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/swtpmtest"
)

// rw is a TPM as the io.ReadWriter LoadOrCreate takes (a device file at boot): one
// Write sends a command, the next Read returns the whole response.
type rw struct {
	t   transport.TPM
	rsp []byte
}

func (r *rw) Write(p []byte) (int, error) {
	rsp, err := r.t.Send(p)
	if err != nil {
		return 0, err
	}
	r.rsp = rsp
	return len(p), nil
}

func (r *rw) Read(p []byte) (int, error) {
	n := copy(p, r.rsp)
	r.rsp = r.rsp[n:]
	return n, nil
}

func loadOrCreate(t *testing.T, sock string) ([]byte, bool) {
	t.Helper()
	tpm, err := attest.OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close() // swtpm serves one client at a time
	key, created, err := LoadOrCreate(&rw{t: tpm})
	if err != nil {
		t.Fatal(err)
	}
	return key, created
}

func TestLoadOrCreate(t *testing.T) {
	tpm := swtpmtest.Start(t, "")
	sock := tpm.Socket()

	k1, created := loadOrCreate(t, sock)
	if !created || len(k1) != 64 {
		t.Fatalf("first call: created=%v, %d byte key", created, len(k1))
	}
	k2, created := loadOrCreate(t, sock)
	if created || !bytes.Equal(k1, k2) {
		t.Fatalf("second call: created=%v, same key %v", created, bytes.Equal(k1, k2))
	}

	// A reboot: swtpm restarts from its saved state.
	tpm.Stop()
	sock = swtpmtest.Start(t, tpm.Dir()).Socket()
	k3, created := loadOrCreate(t, sock)
	if created || !bytes.Equal(k1, k3) {
		t.Fatalf("after restart: created=%v, same key %v", created, bytes.Equal(k1, k3))
	}

	// Another TPM, another key.
	k4, created := loadOrCreate(t, swtpmtest.Start(t, "").Socket())
	if !created || bytes.Equal(k1, k4) {
		t.Fatalf("fresh TPM: created=%v, same key %v", created, bytes.Equal(k1, k4))
	}
}

// An index someone else defined at NVIndex is left alone.
func TestForeignIndex(t *testing.T) {
	sock := swtpmtest.Start(t, "").Socket()
	tpm, err := attest.OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close()
	_, err = tpm2.NVDefineSpace{
		AuthHandle: tpm2.TPMRHOwner,
		PublicInfo: tpm2.New2B(tpm2.TPMSNVPublic{
			NVIndex: NVIndex, NameAlg: tpm2.TPMAlgSHA256, Attributes: attributes, DataSize: 16,
		}),
	}.Execute(tpm)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := LoadOrCreate(&rw{t: tpm}); err == nil {
		t.Fatal("a 16-byte index was used")
	}
	if _, err := (tpm2.NVReadPublic{NVIndex: NVIndex}).Execute(tpm); errors.Is(err, tpm2.TPMRCHandle) {
		t.Fatal("the foreign index was removed")
	}
}

// An index defined but never written (power lost right after the define) gets
// its seed on the next boot.
func TestDefinedNotWritten(t *testing.T) {
	sock := swtpmtest.Start(t, "").Socket()
	tpm, err := attest.OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	if err := define(tpm); err != nil {
		t.Fatal(err)
	}
	tpm.Close()
	k1, created := loadOrCreate(t, sock)
	if !created {
		t.Error("unwritten index: created=false")
	}
	k2, created := loadOrCreate(t, sock)
	if created || !bytes.Equal(k1, k2) {
		t.Errorf("second call: created=%v, same key %v", created, bytes.Equal(k1, k2))
	}
}
