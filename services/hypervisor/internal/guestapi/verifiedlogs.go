package guestapi

import (
	"fmt"
	"os"
	"path/filepath"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
)

// The event logs of a VM's last verified quote, kept in its directory: a
// fork's vTPM is brought to its parent's PCRs by replaying them
// (tpmfork.Replay), so the fork's measurements are the ones attestation
// accepted, not whatever the parent's vTPM holds now. A new boot's first
// verified quote replaces them; the files go with the VM's directory.

// VerifiedLogsDir is where they are, below the VM's directory.
const VerifiedLogsDir = "attested"

// Their files.
const (
	FirmwareLogFile  = "firmware.log"
	UserspaceLogFile = "userspace.log"
)

// VerifiedLogs reads the logs of dir's VM's last verified quote.
func VerifiedLogs(vmDir string) (firmware, userspace []byte, err error) {
	d := filepath.Join(vmDir, VerifiedLogsDir)
	firmware, err = os.ReadFile(filepath.Join(d, FirmwareLogFile))
	if err != nil {
		return nil, nil, fmt.Errorf("the event log of the last verified quote: %w", err)
	}
	userspace, err = os.ReadFile(filepath.Join(d, UserspaceLogFile))
	if err != nil && !os.IsNotExist(err) {
		return nil, nil, err
	}
	return firmware, userspace, nil
}

// keepVerifiedLogs writes q's logs (their size bounded by the IMDS's
// --imds-max-quote-bytes) as the VM's last verified ones.
func (s *Side) keepVerifiedLogs(vmID string, q *attestationv1.VerifyQuoteRequest) {
	rec, err := s.records.Record(vmID)
	if err != nil || rec.GetPaths().GetDir() == "" || len(q.GetEventLog()) == 0 {
		return
	}
	d := filepath.Join(rec.GetPaths().GetDir(), VerifiedLogsDir)
	write := func(name string, b []byte) error {
		tmp := filepath.Join(d, name+".tmp")
		if err := os.WriteFile(tmp, b, 0o600); err != nil {
			return err
		}
		return os.Rename(tmp, filepath.Join(d, name))
	}
	err = os.MkdirAll(d, 0o700)
	if err == nil {
		err = write(UserspaceLogFile, q.GetUserspaceLog())
	}
	if err == nil {
		err = write(FirmwareLogFile, q.GetEventLog())
	}
	if err != nil {
		s.log.Warn("keep the verified quote's event logs (a fork of this VM will not replay them)", "vm", vmID, "error", err)
	}
}
