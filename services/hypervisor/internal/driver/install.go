package driver

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// compareChunk is VerifyInstall's read unit.
const compareChunk = 4 << 20

// VerifyInstall proves an install: the volume's first bytes are the image's
// disk, byte for byte. The guest's installer does not read its copy back
// (under TCG that doubled the install); the host's page cache does this in
// about a second, and it also catches an installer that copied the wrong
// thing without an error.
func (d *Driver) VerifyInstall(rec *storepb.VirtualMachine, img *hypervisorv1.Image) error {
	return sameStart(img.GetDisk(), rec.GetPaths().GetVolume())
}

// sameStart says whether the file at vol begins with the whole file at img.
func sameStart(img, vol string) error {
	a, err := os.Open(img)
	if err != nil {
		return fmt.Errorf("the image's disk: %w", err)
	}
	defer a.Close()
	b, err := os.Open(vol)
	if err != nil {
		return fmt.Errorf("the volume: %w", err)
	}
	defer b.Close()
	bufA, bufB := make([]byte, compareChunk), make([]byte, compareChunk)
	for off := int64(0); ; {
		n, errA := io.ReadFull(a, bufA)
		if n > 0 {
			m, errB := io.ReadFull(b, bufB[:n])
			if m < n {
				return fmt.Errorf("the volume ends at byte %d, before the image's disk does (%v)", off+int64(m), errB)
			}
			if !bytes.Equal(bufA[:n], bufB[:n]) {
				i := int64(0)
				for bufA[i] == bufB[i] {
					i++
				}
				return fmt.Errorf("the volume differs from the image's disk %s at byte %d", img, off+i)
			}
			off += int64(n)
		}
		switch {
		case errors.Is(errA, io.EOF) || errors.Is(errA, io.ErrUnexpectedEOF):
			return nil
		case errA != nil:
			return fmt.Errorf("reading the image's disk: %w", errA)
		}
	}
}
