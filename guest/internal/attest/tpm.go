// Package attest is vm-agent's TPM side of attestation (vm-manager contract §5): it
// keeps the attestation key, quotes PCRs for a boot stage and submits the quote to
// the IMDS.
package attest

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"github.com/google/go-tpm/tpm2/transport/linuxtpm"

	"github.com/giantswarm/vm-manager/pkg/vtpm"
)

// DefaultTPMPath is the kernel's resource-managed TPM device.
const DefaultTPMPath = "/dev/tpmrm0"

// OpenTPM opens the TPM at path: a character device, or a unix socket of swtpm's
// server channel (`swtpm socket --tpm2 --server type=unixio,path=...`). A TPM that
// was never started (TPM_RC_INITIALIZE) gets TPM2_Startup(CLEAR).
func OpenTPM(path string) (transport.TPMCloser, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	var t transport.TPMCloser
	if fi.Mode()&os.ModeSocket != 0 {
		if t, err = vtpm.DialSocket(path, 10*time.Second); err != nil {
			return nil, err
		}
	} else if t, err = linuxtpm.Open(path); err != nil {
		return nil, err
	}
	if err := startup(t); err != nil {
		t.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

func startup(t transport.TPM) error {
	_, err := tpm2.GetCapability{Capability: tpm2.TPMCapTPMProperties, Property: uint32(tpm2.TPMPTManufacturer), PropertyCount: 1}.Execute(t)
	if !errors.Is(err, tpm2.TPMRCInitialize) {
		return err
	}
	if _, err := (tpm2.Startup{StartupType: tpm2.TPMSUClear}).Execute(t); err != nil {
		return fmt.Errorf("TPM2_Startup(CLEAR): %w", err)
	}
	return nil
}

// flush frees a transient object or session; errors are moot at that point, and
// without a resource manager (swtpm, /dev/tpm0) a leaked handle stays until reset.
func flush(t transport.TPM, h tpm2.TPMHandle) { vtpm.Flush(t, h) }
