// Package apierr is vm-manager's one error model, shared by every surface.
//
// A service returns domain errors built here (Errorf, or a sentinel wrapped
// with %w). They are converted once, at the gRPC boundary, into a gRPC status
// that carries a google.rpc.ErrorInfo whose reason is the Code and whose
// domain is "vm-manager". The gateway turns that status into the REST envelope
// {"error":{"code","message"}} (RESTBody, WriteREST) and the MCP tool error
// "<code>: <message>" (MCPText), so a gRPC client, a REST client and an agent
// all see the same code; the IMDS answers guests with IMDSStatus.
//
// SDK users read the code of any error a client returns with CodeOf:
//
//	if apierr.CodeOf(err) == apierr.NotFound { ... }
package apierr

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Domain is the ErrorInfo domain of every vm-manager error.
const Domain = "vm-manager"

// Code is a stable, machine-readable error code.
type Code string

// The codes of the original vm-manager's REST API, plus the ones a split
// service needs (unauthenticated, forbidden, unavailable) and the one of a
// per-host bound (resource_exhausted: too many VMs, networks or forwards).
// One constant a line, so parts of the list look alike; kept, as each is
// its own code.
const (
	InvalidRequest  Code = "invalid_request"
	NotFound        Code = "not_found"
	Conflict        Code = "conflict"
	Unsupported     Code = "unsupported"
	Timeout         Code = "timeout"
	VMFailed        Code = "vm_failed"
	Internal        Code = "internal_error"
	Unauthenticated Code = "unauthenticated"
	Forbidden       Code = "forbidden"
	Unavailable     Code = "unavailable"
	// ResourceExhausted is a per-host bound reached: nothing was created.
	ResourceExhausted Code = "resource_exhausted"
	// OutOfRange is a revision a watch no longer retains: list again, then
	// watch from the list (HTTP 410 Gone, as Kubernetes answers a watch from
	// a compacted resourceVersion).
	OutOfRange Code = "out_of_range"
)

// Codes lists every code, for documentation and tests.
var Codes = []Code{InvalidRequest, NotFound, Conflict, Unsupported, Timeout, VMFailed, Internal, Unauthenticated, Forbidden, Unavailable, ResourceExhausted, OutOfRange}

// Sentinels for errors.Is. Errors built with Errorf match the sentinel of their code.
var (
	ErrInvalid         error = sentinel(InvalidRequest)
	ErrNotFound        error = sentinel(NotFound)
	ErrConflict        error = sentinel(Conflict)
	ErrUnsupported     error = sentinel(Unsupported)
	ErrTimeout         error = sentinel(Timeout)
	ErrFailed          error = sentinel(VMFailed)
	ErrInternal        error = sentinel(Internal)
	ErrUnauthenticated error = sentinel(Unauthenticated)
	ErrForbidden       error = sentinel(Forbidden)
	ErrUnavailable     error = sentinel(Unavailable)
	ErrExhausted       error = sentinel(ResourceExhausted)
	ErrOutOfRange      error = sentinel(OutOfRange)
)

type sentinel Code

func (s sentinel) Error() string { return string(s) }

// Error is a domain error with a code and a message meant for the caller.
type Error struct {
	Code    Code
	Message string
	// Metadata ends up in ErrorInfo.metadata (for example the offending field).
	Metadata map[string]string
	cause    error
}

func (e *Error) Error() string { return e.Message }

// Unwrap returns the wrapped cause, if the message was built with %w.
func (e *Error) Unwrap() error { return e.cause }

// Is matches the sentinel of the error's code.
func (e *Error) Is(target error) bool {
	s, ok := target.(sentinel)
	return ok && Code(s) == e.Code
}

// Errorf builds a domain error; %w in format wraps a cause.
func Errorf(code Code, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	return &Error{Code: code, Message: err.Error(), cause: errors.Unwrap(err)}
}

// Invalidf is Errorf(InvalidRequest, ...) naming the offending field.
func Invalidf(field, format string, args ...any) error {
	e := Errorf(InvalidRequest, format, args...).(*Error)
	e.Metadata = map[string]string{"field": field}
	return e
}

// CodeOf returns the code of err: the code of a domain error or sentinel, the
// ErrorInfo reason of a gRPC status from a vm-manager service, or the nearest
// code for any other gRPC status. nil has no code ("").
func CodeOf(err error) Code {
	if err == nil {
		return ""
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	var s sentinel
	if errors.As(err, &s) {
		return Code(s)
	}
	if st, ok := status.FromError(err); ok {
		if info := errorInfo(st); info != nil {
			return Code(info.GetReason())
		}
		return codeFromGRPC(st.Code())
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return Timeout
	case errors.Is(err, context.Canceled):
		return Unavailable
	}
	return Internal
}

// MessageOf returns the caller-facing message of err: a status's message
// without the gRPC prefix, else err.Error().
func MessageOf(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Message
	}
	if st, ok := status.FromError(err); ok {
		return st.Message()
	}
	return err.Error()
}

// ToStatus converts an error into the gRPC status a vm-manager service
// returns: the gRPC code nearest to the domain code, and an ErrorInfo.
// A status that already carries a vm-manager ErrorInfo passes unchanged, so a
// forwarding proxy does not rewrite what a backend said.
func ToStatus(err error) *status.Status {
	if err == nil {
		return nil
	}
	if st, ok := status.FromError(err); ok && errorInfo(st) != nil {
		return st
	}
	code := CodeOf(err)
	var md map[string]string
	var e *Error
	if errors.As(err, &e) {
		md = e.Metadata
	}
	st := status.New(GRPCCode(code), MessageOf(err))
	withInfo, derr := st.WithDetails(&errdetails.ErrorInfo{Reason: string(code), Domain: Domain, Metadata: md})
	if derr != nil {
		return st
	}
	return withInfo
}

// FromStatus turns a gRPC error back into a domain error, so errors.Is with
// the sentinels works on what an SDK client returns.
func FromStatus(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	e := &Error{Code: CodeOf(err), Message: st.Message(), cause: err}
	if info := errorInfo(st); info != nil {
		e.Metadata = info.GetMetadata()
	}
	return e
}

// HasErrorInfo reports whether err is a gRPC status that a vm-manager
// service sent: one carrying a vm-manager ErrorInfo. A status without one
// came from the gRPC library itself (the connection, a deadline) or from
// something that is not vm-manager.
func HasErrorInfo(err error) bool {
	st, ok := status.FromError(err)
	return ok && err != nil && errorInfo(st) != nil
}

func errorInfo(st *status.Status) *errdetails.ErrorInfo {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == Domain {
			return info
		}
	}
	return nil
}

// wire is how a code travels: its gRPC code and its REST status.
type wire struct {
	grpc codes.Code
	http int
}

// wires maps every code to its gRPC code and REST status; a code not listed
// (VMFailed, Internal, anything unknown) travels as internalWire.
var wires = map[Code]wire{
	InvalidRequest:  {codes.InvalidArgument, http.StatusBadRequest},
	NotFound:        {codes.NotFound, http.StatusNotFound},
	Conflict:        {codes.FailedPrecondition, http.StatusConflict},
	Unsupported:     {codes.Unimplemented, http.StatusNotImplemented},
	Timeout:         {codes.DeadlineExceeded, http.StatusGatewayTimeout},
	Unauthenticated: {codes.Unauthenticated, http.StatusUnauthorized},
	Forbidden:       {codes.PermissionDenied, http.StatusForbidden},
	Unavailable:     {codes.Unavailable, http.StatusServiceUnavailable},
	// 429, as Google's APIs answer RESOURCE_EXHAUSTED: a quota, not a fault.
	ResourceExhausted: {codes.ResourceExhausted, http.StatusTooManyRequests},
	OutOfRange:        {codes.OutOfRange, http.StatusGone},
}

var internalWire = wire{codes.Internal, http.StatusInternalServerError}

func wireOf(c Code) wire {
	if w, ok := wires[c]; ok {
		return w
	}
	return internalWire
}

// GRPCCode is the gRPC code a domain code travels with.
func GRPCCode(c Code) codes.Code { return wireOf(c).grpc }

// HTTPStatus is the REST status of a code.
func HTTPStatus(c Code) int { return wireOf(c).http }

func codeFromGRPC(c codes.Code) Code {
	switch c {
	case codes.OK:
		return ""
	case codes.InvalidArgument:
		return InvalidRequest
	case codes.OutOfRange:
		return OutOfRange
	case codes.NotFound:
		return NotFound
	case codes.AlreadyExists, codes.FailedPrecondition, codes.Aborted:
		return Conflict
	case codes.Unimplemented:
		return Unsupported
	case codes.DeadlineExceeded:
		return Timeout
	case codes.Unauthenticated:
		return Unauthenticated
	case codes.PermissionDenied:
		return Forbidden
	case codes.Unavailable, codes.Canceled:
		return Unavailable
	case codes.ResourceExhausted:
		return ResourceExhausted
	default:
		return Internal
	}
}
