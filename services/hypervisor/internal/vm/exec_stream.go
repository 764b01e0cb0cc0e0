package vm

import (
	"context"
	"errors"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/sshexec"
)

// OpenExec starts a streamed command (or the shell) in the guest over SSH,
// as Exec does for a unary one; the caller validated opts. The session ends
// when ctx does.
func (ax *Access) OpenExec(ctx context.Context, id string, opts sshexec.StreamOptions) (*sshexec.Session, error) {
	t, err := ax.dialSSH(ctx, id)
	if err != nil {
		return nil, err
	}
	s, err := sshexec.Open(ctx, t.conn, t.key, t.pin, opts)
	switch {
	case err == nil:
		// An open session keeps the VM from idling out (lifetimes).
		s.OnClose(ax.activity.Hold(id, ActivityExec))
		return s, nil
	case errors.Is(err, sshexec.ErrHostKeyChanged):
		return nil, apierr.Errorf(apierr.Conflict, "host key of vm %s changed: %v", id, err)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return nil, apierr.Errorf(apierr.Timeout, "vm %s: exec session not started: %v", id, context.Cause(ctx))
	}
	return nil, apierr.Errorf(apierr.Unavailable, "vm %s: exec over SSH failed: %v", id, err)
}
