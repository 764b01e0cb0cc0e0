package vm

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"strings"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// This file is how a boot joins the trace of the call that started it
// (create, start, reboot): its launch, and what the guest asks the IMDS
// until it is ready (nonces and quotes, which reach attestation), are spans
// of that call's trace. The guest's own headers are never read: a guest
// does not choose the trace its requests join.

const tracerName = "github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"

// vmIDKey is the attribute naming the VM a span is about.
const vmIDKey = attribute.Key("vm_manager.vm.id")

// setTrace makes the span on ctx (the call's) the parent of mc's next boot.
// In memory only: a boot re-adopted after a restart, or a guest's own
// reboot, continues whatever was set last, or no trace.
func (mc *machine) setTrace(ctx context.Context) {
	mc.mu.Lock()
	mc.trace = trace.SpanContextFromContext(ctx)
	mc.mu.Unlock()
}

// bootContext is ctx carrying mc's boot span context, if any.
func (mc *machine) bootContext(ctx context.Context) context.Context {
	mc.mu.Lock()
	sc := mc.trace
	mc.mu.Unlock()
	if !sc.IsValid() {
		return ctx
	}
	return trace.ContextWithSpanContext(ctx, sc)
}

// startLaunch is the span of one launch, in the boot's trace.
func (rn *Runner) startLaunch(ctx context.Context, mc *machine, phase hypervisorv1.Phase) (context.Context, trace.Span) {
	return otel.Tracer(tracerName).Start(mc.bootContext(ctx), "vm.launch", trace.WithAttributes(
		vmIDKey.String(mc.id), attribute.String("vm_manager.vm.phase", strings.ToLower(strings.TrimPrefix(phase.String(), "PHASE_"))),
	))
}

// booting says whether a VM's IMDS requests still belong to its boot: until
// it is ready (or up without READY=1, or down), when the guest's periodic
// report uploads begin, which would make a trace without end.
func booting(s hypervisorv1.State) bool {
	switch s {
	case hypervisorv1.State_STATE_CREATING, hypervisorv1.State_STATE_INSTALLING, hypervisorv1.State_STATE_BOOTING, hypervisorv1.State_STATE_ATTESTING:
		return true
	}
	return false
}

// tracedIMDS gives the IMDS requests of a booting VM a server span in its
// boot's trace (otelhttp, with no propagator: the parent is the boot's,
// set here). Other requests get a span without a parent, which the
// hypervisor does not record (tracing.Start). Off, it returns h.
func (tb *Table) tracedIMDS(network string, h http.Handler) http.Handler {
	if !tracing.Enabled() {
		return h
	}
	named := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if id, ok := r.Context().Value(imdsVMKey{}).(string); ok {
			trace.SpanFromContext(r.Context()).SetAttributes(vmIDKey.String(id))
		}
		h.ServeHTTP(w, r)
	})
	spanned := otelhttp.NewHandler(named, "imds",
		// Explicit: otelhttp would take the provider of the span on the
		// context, and the boot's parent is a bare span context (no-op).
		otelhttp.WithTracerProvider(otel.GetTracerProvider()),
		otelhttp.WithPropagators(propagation.NewCompositeTextMapPropagator()),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string {
			return "IMDS " + tracing.Method(r) + " " + imdsRoute(r.URL.Path)
		}),
	)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if mc := tb.bootingHolder(network, r.RemoteAddr); mc != nil {
			ctx := context.WithValue(mc.bootContext(r.Context()), imdsVMKey{}, mc.id)
			r = r.WithContext(ctx)
		}
		spanned.ServeHTTP(w, r)
	})
}

type imdsVMKey struct{}

// bootingHolder is the booting VM holding the lease on the request's peer
// address in network, or nil.
func (tb *Table) bootingHolder(network, remoteAddr string) *machine {
	mc := tb.leaseHolder(network, remoteAddr)
	if mc == nil {
		return nil
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if !booting(mc.rec.GetState()) {
		return nil
	}
	return mc
}

// peerIP is the address of a request's peer.
func peerIP(remoteAddr string) (netip.Addr, bool) {
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		return netip.Addr{}, false
	}
	ip, err := netip.ParseAddr(host)
	return ip.Unmap(), err == nil
}

// imdsRoute is the key-table path a request's path matches ("/attest/nonce",
// "/metadata/{key}"), else "{unmatched}": a guest cannot make up span names.
func imdsRoute(path string) string {
	rest, ok := strings.CutPrefix(path, imds.BasePath)
	if !ok {
		return "{unmatched}"
	}
	got := strings.Split(rest, "/")
	for _, k := range imds.Keys {
		want := strings.Split(k.Path, "/")
		if len(want) != len(got) {
			continue
		}
		match := true
		for i, w := range want {
			switch {
			case w == "{$}":
				match = match && got[i] == ""
			case strings.HasPrefix(w, "{"):
				match = match && got[i] != ""
			default:
				match = match && got[i] == w
			}
		}
		if match {
			return imds.BasePath + k.Path
		}
	}
	return "{unmatched}"
}
