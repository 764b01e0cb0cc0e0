package vm

import (
	"context"
	"errors"
	"net"
	"os"
	"strconv"

	"github.com/giantswarm/vm-manager/gen/apierr"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/sshexec"
)

// OpenExec starts a streamed command (or the shell) in the guest over SSH,
// as Exec does for a unary one; the caller validated opts. The session ends
// when ctx does.
func (m *Manager) OpenExec(ctx context.Context, id string, opts sshexec.StreamOptions) (*sshexec.Session, error) {
	mc, err := m.get(id)
	if err != nil {
		return nil, err
	}
	mc.mu.Lock()
	rec, live := mc.rec, mc.run != nil
	mc.mu.Unlock()
	if !live || rec.GetState() == hypervisorv1.State_STATE_DELETING {
		return nil, apierr.Errorf(apierr.Conflict, "vm %s is %s and has no running process; start it first", id, lifecycle.Name(rec.GetState()))
	}
	ns, ip, err := m.guestAddr(rec)
	if err != nil {
		return nil, err
	}
	key, err := os.ReadFile(rec.GetPaths().GetSshKey())
	if err != nil {
		return nil, apierr.Errorf(apierr.Conflict, "vm %s has no per-VM SSH key (created by an older vm-manager?): %v", id, err)
	}
	dctx, cancel := context.WithTimeout(ctx, sshexec.HandshakeTimeout)
	conn, err := ns.DialContextTCP(dctx, net.JoinHostPort(ip.String(), strconv.Itoa(sshPort)))
	cancel()
	if err != nil {
		return nil, apierr.Errorf(apierr.Unavailable, "vm %s: cannot reach SSH at %s:%d (is the guest up and serving SSH?): %v", id, ip, sshPort, err)
	}
	s, err := sshexec.Open(ctx, conn, key, sshexec.PinFile(rec.GetPaths().GetSshHostKey()), opts)
	switch {
	case err == nil:
		// An open session keeps the VM from idling out (lifetimes).
		s.OnClose(m.Hold(id, ActivityExec))
		return s, nil
	case errors.Is(err, sshexec.ErrHostKeyChanged):
		return nil, apierr.Errorf(apierr.Conflict, "host key of vm %s changed: %v", id, err)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return nil, apierr.Errorf(apierr.Timeout, "vm %s: exec session not started: %v", id, context.Cause(ctx))
	}
	return nil, apierr.Errorf(apierr.Unavailable, "vm %s: exec over SSH failed: %v", id, err)
}
