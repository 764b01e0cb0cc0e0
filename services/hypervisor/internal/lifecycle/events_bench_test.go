package lifecycle

import (
	"fmt"
	"testing"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// BenchmarkPublish is the cost of one change to the VM that makes it, with
// n watchers each draining its channel: what a state change pays for the
// watch.
func BenchmarkPublish(b *testing.B) {
	for _, n := range []int{0, 16, 256} {
		b.Run(fmt.Sprintf("watchers=%d", n), func(b *testing.B) {
			br, _ := NewBroker(0, nil)
			for range n {
				s, _, _ := br.Snapshot(1024)
				go func() {
					for range s.C() {
					}
				}()
			}
			rec := &storepb.VirtualMachine{Id: "0a0b0c0d"}
			b.ResetTimer()
			for range b.N {
				br.Publish(Event{VMID: "0a0b0c0d", Record: rec})
			}
			b.StopTimer()
			if br.Cut() != 0 {
				b.Logf("%d watchers cut off", br.Cut())
			}
			_ = br.Close()
		})
	}
}
