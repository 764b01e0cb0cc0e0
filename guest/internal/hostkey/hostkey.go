// Package hostkey keeps the guest's SSH host key in the vTPM, whose state survives
// reboots: the host pins the key on first use, so it must not change.
package hostkey

import (
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"io"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// NVIndex holds the 32-byte ed25519 seed. It is in the TCG owner range
// (0x01000000-0x013FFFFF), clear of the indices go-tpm-tools knows (EK
// certificates and templates at 0x01C0xxxx, GCE AK ones at 0x01C1xxxx) and of
// the platform ranges firmware and swtpm_setup provision. The low bytes are "SH".
const NVIndex tpm2.TPMHandle = 0x013F5348

// attributes: readable and writable with the index's own (empty) auth, so no
// owner auth is needed after the define; NoDA so that a wrong auth cannot count
// towards the dictionary-attack lockout. No PCR policy: the key must survive
// a changed boot chain.
var attributes = tpm2.TPMANV{
	OwnerWrite: true,
	OwnerRead:  true,
	AuthWrite:  true,
	AuthRead:   true,
	NoDA:       true,
	NT:         tpm2.TPMNTOrdinary,
}

// LoadOrCreate returns the host key whose seed is at NVIndex, defining the index
// (owner auth empty) and filling it with random bytes first if needed; created
// says the key is new. An index of another size or kind is not touched.
func LoadOrCreate(rw io.ReadWriter) (key ed25519.PrivateKey, created bool, err error) {
	t := transport.FromReadWriter(rw)
	pub, err := readPublic(t)
	if errors.Is(err, tpm2.TPMRCHandle) {
		if err := define(t); err != nil {
			return nil, false, err
		}
		created = true
		pub, err = readPublic(t)
	}
	if err != nil {
		return nil, false, err
	}
	if err := check(pub); err != nil {
		return nil, false, err
	}
	if !pub.Attributes.Written {
		// Defined but never written (e.g. power lost right after the define).
		seed := make([]byte, ed25519.SeedSize)
		if _, err := rand.Read(seed); err != nil {
			return nil, false, err
		}
		if err := write(t, seed); err != nil {
			return nil, false, err
		}
		created = true
	}
	seed, err := read(t)
	if err != nil {
		return nil, false, err
	}
	return ed25519.NewKeyFromSeed(seed), created, nil
}

type public struct {
	tpm2.TPMSNVPublic
	name tpm2.TPM2BName
}

func readPublic(t transport.TPM) (*public, error) {
	rsp, err := tpm2.NVReadPublic{NVIndex: NVIndex}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("reading NV index %#x: %w", uint32(NVIndex), err)
	}
	p, err := rsp.NVPublic.Contents()
	if err != nil {
		return nil, err
	}
	return &public{TPMSNVPublic: *p, name: rsp.NVName}, nil
}

func check(p *public) error {
	a := p.Attributes
	if p.DataSize != ed25519.SeedSize || a.NT != tpm2.TPMNTOrdinary || !a.AuthRead || !a.AuthWrite || a.ReadLocked {
		return fmt.Errorf("NV index %#x exists but is not a host key seed (size %d, type %d)", uint32(NVIndex), p.DataSize, a.NT)
	}
	return nil
}

func define(t transport.TPM) error {
	_, err := tpm2.NVDefineSpace{
		AuthHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)},
		PublicInfo: tpm2.New2B(tpm2.TPMSNVPublic{
			NVIndex:    NVIndex,
			NameAlg:    tpm2.TPMAlgSHA256,
			Attributes: attributes,
			DataSize:   ed25519.SeedSize,
		}),
	}.Execute(t)
	if err != nil {
		return fmt.Errorf("defining NV index %#x: %w", uint32(NVIndex), err)
	}
	return nil
}

// write and read authorize with the index's own empty auth: the name changes
// with the WRITTEN bit, so it is read fresh each time.
func write(t transport.TPM, seed []byte) error {
	p, err := readPublic(t)
	if err != nil {
		return err
	}
	h := tpm2.AuthHandle{Handle: NVIndex, Name: p.name, Auth: tpm2.PasswordAuth(nil)}
	_, err = tpm2.NVWrite{
		AuthHandle: h,
		NVIndex:    tpm2.NamedHandle{Handle: NVIndex, Name: p.name},
		Data:       tpm2.TPM2BMaxNVBuffer{Buffer: seed},
	}.Execute(t)
	if err != nil {
		return fmt.Errorf("writing NV index %#x: %w", uint32(NVIndex), err)
	}
	return nil
}

func read(t transport.TPM) ([]byte, error) {
	p, err := readPublic(t)
	if err != nil {
		return nil, err
	}
	h := tpm2.AuthHandle{Handle: NVIndex, Name: p.name, Auth: tpm2.PasswordAuth(nil)}
	rsp, err := tpm2.NVRead{
		AuthHandle: h,
		NVIndex:    tpm2.NamedHandle{Handle: NVIndex, Name: p.name},
		Size:       ed25519.SeedSize,
	}.Execute(t)
	if err != nil {
		return nil, fmt.Errorf("reading NV index %#x: %w", uint32(NVIndex), err)
	}
	if len(rsp.Data.Buffer) != ed25519.SeedSize {
		return nil, fmt.Errorf("NV index %#x: read %d bytes", uint32(NVIndex), len(rsp.Data.Buffer))
	}
	return rsp.Data.Buffer, nil
}
