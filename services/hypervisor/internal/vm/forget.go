package vm

import (
	"context"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
)

// forgetRetry is how often queued forgets are retried.
const forgetRetry = 2 * time.Second

// forget asks attestation to forget a deleted VM (its AK pin, nonces and
// verdicts). The store queued it with the record's deletion; a failure
// (attestation down or restarting) leaves it queued for forgetLoop.
func (m *Manager) forget(id string) error {
	ctx, cancel := context.WithTimeout(m.ctx, 5*time.Second)
	defer cancel()
	if _, err := m.verifier.ForgetVirtualMachine(ctx, &attestationv1.ForgetVirtualMachineRequest{VmId: id}); err != nil {
		return err
	}
	return m.store.Forgotten(id)
}

// forgetLoop retries the forgets still queued, the ones a previous
// hypervisor left included, until the hypervisor stops.
func (m *Manager) forgetLoop() {
	if m.verifier == nil {
		return
	}
	for {
		ids, err := m.store.PendingForgets()
		if err != nil {
			m.log.Warn("list vms attestation has to forget", "error", err)
		}
		for _, id := range ids {
			if err := m.forget(id); err != nil {
				m.log.Debug("attestation has not forgotten a deleted vm yet; retrying", "vm", id, "error", err)
				break // attestation is down: try again later
			}
			m.log.Info("attestation forgot a vm deleted earlier", "vm", id)
		}
		select {
		case <-m.ctx.Done():
			return
		case <-time.After(forgetRetry):
		}
	}
}
