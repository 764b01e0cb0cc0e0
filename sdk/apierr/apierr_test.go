package apierr_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var sentinels = map[apierr.Code]error{
	apierr.InvalidRequest:    apierr.ErrInvalid,
	apierr.NotFound:          apierr.ErrNotFound,
	apierr.Conflict:          apierr.ErrConflict,
	apierr.Unsupported:       apierr.ErrUnsupported,
	apierr.Timeout:           apierr.ErrTimeout,
	apierr.VMFailed:          apierr.ErrFailed,
	apierr.Internal:          apierr.ErrInternal,
	apierr.Unauthenticated:   apierr.ErrUnauthenticated,
	apierr.Forbidden:         apierr.ErrForbidden,
	apierr.Unavailable:       apierr.ErrUnavailable,
	apierr.ResourceExhausted: apierr.ErrExhausted,
	apierr.OutOfRange:        apierr.ErrOutOfRange,
}

var wantGRPC = map[apierr.Code]codes.Code{
	apierr.InvalidRequest:    codes.InvalidArgument,
	apierr.NotFound:          codes.NotFound,
	apierr.Conflict:          codes.FailedPrecondition,
	apierr.Unsupported:       codes.Unimplemented,
	apierr.Timeout:           codes.DeadlineExceeded,
	apierr.VMFailed:          codes.Internal,
	apierr.Internal:          codes.Internal,
	apierr.Unauthenticated:   codes.Unauthenticated,
	apierr.Forbidden:         codes.PermissionDenied,
	apierr.Unavailable:       codes.Unavailable,
	apierr.ResourceExhausted: codes.ResourceExhausted,
	apierr.OutOfRange:        codes.OutOfRange,
}

func errorInfo(t *testing.T, st *status.Status) *errdetails.ErrorInfo {
	t.Helper()
	var found *errdetails.ErrorInfo
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			if found != nil {
				t.Fatalf("status carries more than one ErrorInfo: %v", st.Details())
			}
			found = info
		}
	}
	return found
}

func TestCodesListIsComplete(t *testing.T) {
	if len(apierr.Codes) != 12 {
		t.Fatalf("len(Codes) = %d, want 12", len(apierr.Codes))
	}
	seen := map[apierr.Code]bool{}
	for _, c := range apierr.Codes {
		if seen[c] {
			t.Errorf("duplicate code %q", c)
		}
		seen[c] = true
		if _, ok := sentinels[c]; !ok {
			t.Errorf("code %q has no sentinel in this test", c)
		}
	}
}

func TestRoundTripEveryCode(t *testing.T) {
	for _, code := range apierr.Codes {
		t.Run(string(code), func(t *testing.T) {
			err := apierr.Errorf(code, "thing %q went %d ways", "vm1", 3)
			wantMsg := `thing "vm1" went 3 ways`
			if got := err.Error(); got != wantMsg {
				t.Errorf("Error() = %q, want %q", got, wantMsg)
			}
			if !errors.Is(err, sentinels[code]) {
				t.Errorf("errors.Is(Errorf(%s), sentinel) = false", code)
			}
			for other, s := range sentinels {
				if other != code && errors.Is(err, s) {
					t.Errorf("errors.Is(Errorf(%s), sentinel of %s) = true", code, other)
				}
			}

			st := apierr.ToStatus(err)
			if st.Code() != apierr.GRPCCode(code) {
				t.Errorf("status code = %v, want GRPCCode = %v", st.Code(), apierr.GRPCCode(code))
			}
			if st.Code() != wantGRPC[code] {
				t.Errorf("status code = %v, want %v", st.Code(), wantGRPC[code])
			}
			if st.Message() != wantMsg {
				t.Errorf("status message = %q, want %q", st.Message(), wantMsg)
			}
			info := errorInfo(t, st)
			if info == nil {
				t.Fatalf("status has no ErrorInfo: %v", st.Details())
			}
			if info.GetReason() != string(code) {
				t.Errorf("ErrorInfo.Reason = %q, want %q", info.GetReason(), code)
			}
			if info.GetDomain() != "vm-manager" {
				t.Errorf("ErrorInfo.Domain = %q, want vm-manager", info.GetDomain())
			}

			serr := st.Err()
			if got := apierr.CodeOf(serr); got != code {
				t.Errorf("CodeOf(status.Err()) = %q, want %q", got, code)
			}
			if got := apierr.MessageOf(serr); got != wantMsg {
				t.Errorf("MessageOf(status.Err()) = %q, want %q", got, wantMsg)
			}
			back := apierr.FromStatus(serr)
			if !errors.Is(back, sentinels[code]) {
				t.Errorf("errors.Is(FromStatus(..), sentinel of %s) = false", code)
			}
			if got := apierr.CodeOf(back); got != code {
				t.Errorf("CodeOf(FromStatus(..)) = %q, want %q", got, code)
			}
			if got := back.Error(); got != wantMsg {
				t.Errorf("FromStatus(..).Error() = %q, want %q", got, wantMsg)
			}
		})
	}
}

func TestSentinelCodeOf(t *testing.T) {
	for code, s := range sentinels {
		if got := apierr.CodeOf(s); got != code {
			t.Errorf("CodeOf(sentinel %s) = %q", code, got)
		}
		wrapped := fmt.Errorf("ctx: %w", s)
		if got := apierr.CodeOf(wrapped); got != code {
			t.Errorf("CodeOf(wrapped sentinel %s) = %q", code, got)
		}
		if got := apierr.ToStatus(wrapped).Code(); got != wantGRPC[code] {
			t.Errorf("ToStatus(wrapped sentinel %s).Code() = %v, want %v", code, got, wantGRPC[code])
		}
	}
}

func TestErrorfWrapsCause(t *testing.T) {
	err := apierr.Errorf(apierr.NotFound, "open image: %w", io.ErrUnexpectedEOF)
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("errors.Is(err, cause) = false")
	}
	if !errors.Is(err, apierr.ErrNotFound) {
		t.Errorf("errors.Is(err, ErrNotFound) = false")
	}
	if got := errors.Unwrap(err); got != io.ErrUnexpectedEOF {
		t.Errorf("Unwrap = %v, want io.ErrUnexpectedEOF", got)
	}
	if got, want := err.Error(), "open image: unexpected EOF"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	// A wrapped cause that is itself a domain error does not change the code.
	inner := apierr.Errorf(apierr.Conflict, "busy")
	outer := apierr.Errorf(apierr.Timeout, "wait: %w", inner)
	if got := apierr.CodeOf(outer); got != apierr.Timeout {
		t.Errorf("CodeOf(outer) = %q, want timeout", got)
	}
	// Without %w there is no cause.
	if errors.Unwrap(apierr.Errorf(apierr.Internal, "x %v", io.EOF)) != nil {
		t.Errorf("Errorf with %%v should not wrap")
	}
}

func TestInvalidfFieldSurvivesStatus(t *testing.T) {
	err := apierr.Invalidf("memory_mib", "must be at least %d", 128)
	if got := apierr.CodeOf(err); got != apierr.InvalidRequest {
		t.Fatalf("CodeOf = %q", got)
	}
	var e *apierr.Error
	if !errors.As(err, &e) || e.Metadata["field"] != "memory_mib" {
		t.Fatalf("Metadata = %v, want field=memory_mib", e)
	}
	st := apierr.ToStatus(err)
	info := errorInfo(t, st)
	if info == nil || info.GetMetadata()["field"] != "memory_mib" {
		t.Fatalf("ErrorInfo metadata = %v", info.GetMetadata())
	}
	back := apierr.FromStatus(st.Err())
	var be *apierr.Error
	if !errors.As(back, &be) {
		t.Fatalf("FromStatus did not return *apierr.Error: %T", back)
	}
	if be.Metadata["field"] != "memory_mib" {
		t.Errorf("FromStatus metadata = %v", be.Metadata)
	}
	if be.Message != "must be at least 128" {
		t.Errorf("FromStatus message = %q", be.Message)
	}
	if !errors.Is(back, apierr.ErrInvalid) {
		t.Errorf("errors.Is(back, ErrInvalid) = false")
	}
	// The original status error stays reachable.
	if st2, ok := status.FromError(errors.Unwrap(back)); !ok || st2.Code() != codes.InvalidArgument {
		t.Errorf("FromStatus cause is not the status: %v", errors.Unwrap(back))
	}
}

func TestPlainStatusMapsByGRPCCode(t *testing.T) {
	cases := []struct {
		grpc codes.Code
		want apierr.Code
	}{
		{codes.Unavailable, apierr.Unavailable},
		{codes.InvalidArgument, apierr.InvalidRequest},
		{codes.Unimplemented, apierr.Unsupported},
		{codes.NotFound, apierr.NotFound},
		{codes.AlreadyExists, apierr.Conflict},
		{codes.FailedPrecondition, apierr.Conflict},
		{codes.DeadlineExceeded, apierr.Timeout},
		{codes.PermissionDenied, apierr.Forbidden},
		{codes.Unauthenticated, apierr.Unauthenticated},
		{codes.ResourceExhausted, apierr.ResourceExhausted},
		{codes.Unknown, apierr.Internal},
		{codes.DataLoss, apierr.Internal},
	}
	for _, c := range cases {
		err := status.Error(c.grpc, "backend says no")
		if got := apierr.CodeOf(err); got != c.want {
			t.Errorf("CodeOf(status %v) = %q, want %q", c.grpc, got, c.want)
		}
		if got := apierr.MessageOf(err); got != "backend says no" {
			t.Errorf("MessageOf(status %v) = %q", c.grpc, got)
		}
		back := apierr.FromStatus(err)
		if !errors.Is(back, sentinels[c.want]) {
			t.Errorf("FromStatus(status %v) is not %s", c.grpc, c.want)
		}
		// ToStatus adds the ErrorInfo for the mapped code.
		st := apierr.ToStatus(err)
		info := errorInfo(t, st)
		if info == nil || info.GetReason() != string(c.want) {
			t.Errorf("ToStatus(status %v) ErrorInfo = %v, want reason %q", c.grpc, info, c.want)
		}
	}
	// A status whose ErrorInfo comes from another domain is treated as plain.
	st, err := status.New(codes.NotFound, "foreign").WithDetails(&errdetails.ErrorInfo{Reason: "conflict", Domain: "example.com"})
	if err != nil {
		t.Fatal(err)
	}
	if got := apierr.CodeOf(st.Err()); got != apierr.NotFound {
		t.Errorf("CodeOf(foreign ErrorInfo) = %q, want not_found", got)
	}
}

func TestNonStatusErrors(t *testing.T) {
	if got := apierr.CodeOf(context.DeadlineExceeded); got != apierr.Timeout {
		t.Errorf("CodeOf(DeadlineExceeded) = %q, want timeout", got)
	}
	if got := apierr.CodeOf(fmt.Errorf("dial: %w", context.DeadlineExceeded)); got != apierr.Timeout {
		t.Errorf("CodeOf(wrapped DeadlineExceeded) = %q, want timeout", got)
	}
	if got := apierr.CodeOf(context.Canceled); got != apierr.Unavailable {
		t.Errorf("CodeOf(Canceled) = %q, want unavailable", got)
	}
	plain := errors.New("disk on fire")
	if got := apierr.CodeOf(plain); got != apierr.Internal {
		t.Errorf("CodeOf(errors.New) = %q, want internal_error", got)
	}
	if got := apierr.MessageOf(plain); got != "disk on fire" {
		t.Errorf("MessageOf(errors.New) = %q", got)
	}
	st := apierr.ToStatus(plain)
	if st.Code() != codes.Internal || st.Message() != "disk on fire" {
		t.Errorf("ToStatus(errors.New) = %v %q", st.Code(), st.Message())
	}
	if info := errorInfo(t, st); info == nil || info.GetReason() != "internal_error" {
		t.Errorf("ToStatus(errors.New) ErrorInfo = %v", info)
	}
	st = apierr.ToStatus(context.DeadlineExceeded)
	if st.Code() != codes.DeadlineExceeded {
		t.Errorf("ToStatus(DeadlineExceeded).Code() = %v", st.Code())
	}
	// FromStatus passes a non-status error through unchanged.
	if got := apierr.FromStatus(plain); got != plain {
		t.Errorf("FromStatus(non-status) = %v, want the same error", got)
	}
}

func TestNil(t *testing.T) {
	if got := apierr.CodeOf(nil); got != "" {
		t.Errorf("CodeOf(nil) = %q", got)
	}
	if apierr.ToStatus(nil) != nil {
		t.Errorf("ToStatus(nil) != nil")
	}
	if apierr.FromStatus(nil) != nil {
		t.Errorf("FromStatus(nil) != nil")
	}
}

func TestHTTPStatus(t *testing.T) {
	want := map[apierr.Code]int{
		apierr.InvalidRequest:    400,
		apierr.NotFound:          404,
		apierr.Conflict:          409,
		apierr.Unsupported:       501,
		apierr.Timeout:           504,
		apierr.VMFailed:          500,
		apierr.Internal:          500,
		apierr.Unauthenticated:   401,
		apierr.Forbidden:         403,
		apierr.Unavailable:       503,
		apierr.ResourceExhausted: 429,
		apierr.OutOfRange:        410,
	}
	for _, c := range apierr.Codes {
		w, ok := want[c]
		if !ok {
			t.Errorf("no expected HTTP status for %q", c)
			continue
		}
		if got := apierr.HTTPStatus(c); got != w {
			t.Errorf("HTTPStatus(%q) = %d, want %d", c, got, w)
		}
	}
	if got := apierr.HTTPStatus("something_else"); got != 500 {
		t.Errorf("HTTPStatus(unknown) = %d, want 500", got)
	}
}

func TestToStatusPassesThroughVMManagerStatus(t *testing.T) {
	// A backend said conflict with field metadata; a proxy must not rewrite it.
	orig := apierr.ToStatus(apierr.Invalidf("name", "bad name"))
	got := apierr.ToStatus(orig.Err())
	if got.Code() != orig.Code() || got.Message() != orig.Message() {
		t.Fatalf("ToStatus changed status: %v %q", got.Code(), got.Message())
	}
	info := errorInfo(t, got)
	if info == nil || info.GetReason() != "invalid_request" || info.GetMetadata()["field"] != "name" {
		t.Fatalf("ErrorInfo changed: %v", info)
	}
	// Even when the reason and gRPC code disagree with the mapping, it is kept.
	odd, err := status.New(codes.Unavailable, "backend").WithDetails(&errdetails.ErrorInfo{Reason: "vm_failed", Domain: "vm-manager"})
	if err != nil {
		t.Fatal(err)
	}
	got = apierr.ToStatus(odd.Err())
	if got.Code() != codes.Unavailable {
		t.Errorf("code rewritten to %v", got.Code())
	}
	if apierr.CodeOf(got.Err()) != apierr.VMFailed {
		t.Errorf("reason rewritten to %q", apierr.CodeOf(got.Err()))
	}
	if len(got.Details()) != 1 {
		t.Errorf("details = %d, want 1 (no ErrorInfo added)", len(got.Details()))
	}
}
