package metrics

import (
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"google.golang.org/protobuf/types/known/timestamppb"
)

func TestLifetimeMetrics(t *testing.T) {
	m, fake, _ := newHost(t)
	exp := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	active := time.Now().Add(-90 * time.Second)
	fake.mu.Lock()
	fake.vms = []*hypervisorv1.VirtualMachine{
		{Id: "aaaa0001", Name: "a", State: hypervisorv1.State_STATE_READY, Lifetime: &hypervisorv1.Lifetime{
			ExpireAt: timestamppb.New(exp), OnExpire: hypervisorv1.OnExpire_ON_EXPIRE_DELETE,
			IdleTimeout: "15m0s", OnIdle: hypervisorv1.OnIdle_ON_IDLE_STOP, LastActivityAt: timestamppb.New(active)}},
		{Id: "bbbb0002", Name: "b", State: hypervisorv1.State_STATE_STOPPED, Lifetime: &hypervisorv1.Lifetime{
			IdleTimeout: "1m0s", OnIdle: hypervisorv1.OnIdle_ON_IDLE_STOP, LastActivityAt: timestamppb.New(active)}},
		{Id: "cccc0003", Name: "c", State: hypervisorv1.State_STATE_READY},
	}
	fake.bounds = &hypervisorv1.GetBoundCountersResponse{LifetimeActionsTotal: map[string]uint64{"idle_stop": 2}}
	fake.mu.Unlock()
	f := scrape(t, m)
	f.want(t, float64(exp.Unix()), "vm_manager_vm_expire_timestamp_seconds", "vm", "aaaa0001", "name", "a", "on_expire", "delete")
	f.want(t, 900, "vm_manager_vm_idle_timeout_seconds", "vm", "aaaa0001", "name", "a", "on_idle", "stop")
	f.want(t, 60, "vm_manager_vm_idle_timeout_seconds", "vm", "bbbb0002", "name", "b", "on_idle", "stop")
	idle := f.find("vm_manager_vm_idle_seconds")
	if len(idle) != 1 || idle[0].GetGauge().GetValue() < 89 || idle[0].GetGauge().GetValue() > 120 {
		t.Errorf("idle seconds (the ready VM's only): %v", idle)
	}
	if n := len(f.find("vm_manager_vm_expire_timestamp_seconds")); n != 1 {
		t.Errorf("%d expiry series, want the one VM's with an expiry", n)
	}
	f.want(t, 2, "vm_manager_vm_lifetime_actions_total", "reason", "idle", "action", "stop")
	f.want(t, 0, "vm_manager_vm_lifetime_actions_total", "reason", "expired", "action", "delete")
}
