package mcp

import (
	"context"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Lifetimes: create_vm's arguments and update_vm_lifetime (docs/mcp.md).

// lifetimeArgs are the lifetime arguments create_vm takes.
type lifetimeArgs struct {
	TTL         string `json:"ttl,omitempty" jsonschema:"the VM's expiry from now, a Go duration such as \"60s\", \"30m\" or \"2h\" (at most the server's --max-vm-ttl); give ttl or expire_at; default: the server's --default-vm-ttl, normally none"`
	ExpireAt    string `json:"expire_at,omitempty" jsonschema:"the VM's expiry as an RFC 3339 time, such as \"2030-01-02T15:04:05Z\""`
	OnExpire    string `json:"on_expire,omitempty" jsonschema:"what happens at the expiry: stop (the default; the disk stays) or delete (the VM is gone)" schema:"enum=stop|delete,zero"`
	IdleTimeout string `json:"idle_timeout,omitempty" jsonschema:"stop (or suspend, on_idle) the VM after this long without exec, forward or IMDS traffic, a Go duration of at least 10s such as \"15m\"; default: never"`
	OnIdle      string `json:"on_idle,omitempty" jsonschema:"what happens when idle: stop (the default) or suspend (resume_vm continues it)" schema:"enum=stop|suspend,zero"`
}

type updateLifetimeArgs struct {
	ID          string  `json:"id" jsonschema:"the VM id (8 hex characters)"`
	TTL         string  `json:"ttl,omitempty" jsonschema:"a new expiry from now, a Go duration such as \"30m\" or \"2h\"; give ttl, expire_at or clear_expiry, or none to keep the expiry"`
	ExpireAt    string  `json:"expire_at,omitempty" jsonschema:"a new expiry as an RFC 3339 time"`
	ClearExpiry bool    `json:"clear_expiry,omitempty" jsonschema:"remove the expiry: the VM lives until deleted"`
	OnExpire    string  `json:"on_expire,omitempty" jsonschema:"stop or delete at the expiry; absent keeps the VM's" schema:"enum=stop|delete,zero"`
	IdleTimeout *string `json:"idle_timeout,omitempty" jsonschema:"a new idle timeout (a Go duration of at least 10s), \"0s\" to turn it off; absent keeps it"`
	OnIdle      string  `json:"on_idle,omitempty" jsonschema:"stop or suspend when idle; absent keeps the VM's" schema:"enum=stop|suspend,zero"`
}

var (
	onExpire = map[string]hypervisorv1.OnExpire{
		"":       hypervisorv1.OnExpire_ON_EXPIRE_UNSPECIFIED,
		"stop":   hypervisorv1.OnExpire_ON_EXPIRE_STOP,
		"delete": hypervisorv1.OnExpire_ON_EXPIRE_DELETE,
	}
	onIdle = map[string]hypervisorv1.OnIdle{
		"":        hypervisorv1.OnIdle_ON_IDLE_UNSPECIFIED,
		"stop":    hypervisorv1.OnIdle_ON_IDLE_STOP,
		"suspend": hypervisorv1.OnIdle_ON_IDLE_SUSPEND,
	}
)

// lifetimeFields checks the enums and the time (the schema catches the
// enums first) and returns them as the API's.
func lifetimeFields(expireAt, exp, idle string) (*timestamppb.Timestamp, hypervisorv1.OnExpire, hypervisorv1.OnIdle, error) {
	oe, ok := onExpire[exp]
	if !ok {
		return nil, 0, 0, apierr.Invalidf("on_expire", "on_expire: %q is not stop or delete", exp)
	}
	oi, ok := onIdle[idle]
	if !ok {
		return nil, 0, 0, apierr.Invalidf("on_idle", "on_idle: %q is not stop or suspend", idle)
	}
	if expireAt == "" {
		return nil, oe, oi, nil
	}
	t, err := time.Parse(time.RFC3339, expireAt)
	if err != nil {
		return nil, 0, 0, apierr.Invalidf("expire_at", "expire_at %q is not an RFC 3339 time such as 2030-01-02T15:04:05Z", expireAt)
	}
	return timestamppb.New(t), oe, oi, nil
}

// apply sets a create request's lifetime fields.
func (a *lifetimeArgs) apply(req *hypervisorv1.CreateVirtualMachineRequest) error {
	at, oe, oi, err := lifetimeFields(a.ExpireAt, a.OnExpire, a.OnIdle)
	if err != nil {
		return err
	}
	req.Ttl, req.ExpireAt, req.OnExpire, req.IdleTimeout, req.OnIdle = a.TTL, at, oe, a.IdleTimeout, oi
	return nil
}

func (t *tools) updateLifetime(ctx context.Context, _ *mcp.CallToolRequest, in *updateLifetimeArgs) (*hypervisorv1.VirtualMachine, error) {
	at, oe, oi, err := lifetimeFields(in.ExpireAt, in.OnExpire, in.OnIdle)
	if err != nil {
		return nil, err
	}
	return t.hv.UpdateVirtualMachineLifetime(ctx, &hypervisorv1.UpdateVirtualMachineLifetimeRequest{
		Id: in.ID, Ttl: in.TTL, ExpireAt: at, ClearExpiry: in.ClearExpiry, OnExpire: oe, IdleTimeout: in.IdleTimeout, OnIdle: oi,
	})
}
