package metrics

import (
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	dto "github.com/prometheus/client_model/go"
)

// Two guests exporting one family with different types would make the
// exposition invalid: the second one's series is left out, the rest served.
func TestGuestCollectorTypeConflict(t *testing.T) {
	m, fake, _ := newHost(t)
	fake.mu.Lock()
	fake.guests = []*hypervisorv1.VirtualMachineGuestSeries{
		{VmId: "aaaa0001", Series: []*hypervisorv1.GuestSeries{
			{Name: "x", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_COUNTER, Value: 5},
			{Name: "y", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE, Value: 1},
		}},
		{VmId: "bbbb0002", Series: []*hypervisorv1.GuestSeries{
			{Name: "x", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE, Value: 7},
			{Name: "y", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE, Labels: map[string]string{"a": "b"}, Value: 2},
		}},
	}
	fake.mu.Unlock()
	f := scrape(t, m)
	f.wantType(t, "vm_guest_x", dto.MetricType_COUNTER)
	if n := len(f.find("vm_guest_x")); n != 1 {
		t.Errorf("vm_guest_x: %d series, want aaaa0001's only", n)
	}
	f.want(t, 2, "vm_guest_y", "vm", "bbbb0002", "a", "b")
	f.want(t, 1, "vm_guest_y", "vm", "aaaa0001")
}
