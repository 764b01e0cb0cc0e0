package agent

import (
	"context"
	"strings"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/guest/internal/pcrextend"
	"github.com/giantswarm/vm-manager/guest/internal/sysext"
	"github.com/giantswarm/vm-manager/pkg/measure"
)

// extender is what the boot measures through (pcrextend.Extender).
type extender interface {
	Extend(pcr uint32, word, eventType string) ([]string, error)
}

// phases extends the boot-phase words into PCR 11 as systemd-pcrphase does,
// but only on a UKI boot: a direct-kernel boot's PCR 11 stays zero.
type phases struct {
	con *Console
	ext extender // nil: not booted through systemd-stub
}

// detectPhases mounts efivarfs and looks for systemd-stub's variable.
func detectPhases(con *Console) *phases {
	ph := &phases{con: con}
	if err := pcrextend.MountEFIVars(); err != nil {
		con.Printf("boot phases not measured: %v", err)
		return ph
	}
	if !pcrextend.StubBooted(pcrextend.EFIVarsDir) {
		con.Printf("not booted through systemd-stub (no EFI variable %s): boot phases not measured", pcrextend.StubVariable)
		return ph
	}
	con.Printf("booted through systemd-stub (EFI variable %s): boot phases go into PCR %d", pcrextend.StubVariable, measure.PCRKernelImage)
	ph.ext = pcrextend.New()
	return ph
}

// enter extends one phase word. A failure only prints: the quote's PCR 11
// then tells the verifier, and the VM still becomes ready.
func (ph *phases) enter(word string) {
	if ph == nil || ph.ext == nil {
		return
	}
	start := time.Now()
	banks, err := ph.ext.Extend(measure.PCRKernelImage, word, measure.EventTypePhase)
	if err != nil {
		ph.con.Printf("warning: boot phase %q: %v", word, err)
		return
	}
	ph.con.Printf("boot phase %q extended into PCR %d (%s) in %.3fs", word, measure.PCRKernelImage, strings.Join(banks, ", "), time.Since(start).Seconds())
}

// sysextTimeout bounds the whole sysext step: fetching 512 MiB over the
// IMDS must not hold up readiness forever.
const sysextTimeout = 3 * time.Minute

// kubernetesSysext is the PID 1 sysext step.
func kubernetesSysext(con *Console, cl *imdsclient.Client) func(context.Context) sysext.Result {
	return func(ctx context.Context) sysext.Result {
		ctx, cancel := context.WithTimeout(ctx, sysextTimeout)
		defer cancel()
		start := time.Now()
		r := sysext.Run(ctx, sysext.Config{
			IMDS:    cl,
			Measure: pcrextend.New(),
			Merge:   sysext.LoopMount{},
			Logf:    con.Printf,
		})
		if r.Version != "" {
			con.Printf("sysext: kubernetes %s %s in %.2fs", r.Version, r.State, time.Since(start).Seconds())
		}
		return r
	}
}
