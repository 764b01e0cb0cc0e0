// Package rest serves the REST API through grpc-gateway with the contract's
// conventions: the restjson shapes, 201 on create, 204 on delete, an 8 MiB
// body limit and the error envelope {"error":{"code","message"}}.
package rest

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"path"
	"strings"

	"github.com/giantswarm/vm-manager/gen/apierr"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/protobuf/proto"
)

// MaxBodyBytes is the request body limit, sized for user_data.
const MaxBodyBytes = 8 << 20

// NewMux returns a grpc-gateway mux with vm-manager's conventions.
func NewMux(log *slog.Logger) *runtime.ServeMux {
	return runtime.NewServeMux(
		runtime.WithMarshalerOption(runtime.MIMEWildcard, restjson.Marshaler{}),
		runtime.WithErrorHandler(func(ctx context.Context, _ *runtime.ServeMux, _ runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
			code := apierr.CodeOf(err)
			status := apierr.HTTPStatus(code)
			msg := apierr.MessageOf(err)
			if code == apierr.Unavailable {
				if method, ok := runtime.RPCMethod(ctx); ok {
					msg = fmt.Sprintf("the %s service is unavailable: %s", BackendOf(method), msg)
				}
			}
			if status >= 500 {
				log.Error("request failed", "method", r.Method, "path", r.URL.Path, "status", status, "code", code, "error", msg)
			}
			WriteError(w, status, code, msg)
		}),
		runtime.WithRoutingErrorHandler(func(_ context.Context, _ *runtime.ServeMux, _ runtime.Marshaler, w http.ResponseWriter, r *http.Request, httpStatus int) {
			switch httpStatus {
			case http.StatusMethodNotAllowed:
				WriteError(w, http.StatusMethodNotAllowed, apierr.InvalidRequest, fmt.Sprintf("method %s is not allowed on %s", r.Method, r.URL.Path))
			default:
				WriteError(w, http.StatusNotFound, apierr.NotFound, fmt.Sprintf("no route %s %s", r.Method, r.URL.Path))
			}
		}),
		runtime.WithForwardResponseOption(setStatus),
	)
}

// BackendOf names the process behind a full gRPC method name
// ("/vmmanager.hypervisor.v1.HypervisorService/GetHost" is "hypervisor").
func BackendOf(method string) string {
	parts := strings.SplitN(strings.TrimPrefix(method, "/"), ".", 3)
	if len(parts) == 3 && parts[0] == "vmmanager" {
		return parts[1]
	}
	return "backend"
}

// setStatus answers 201 for creates and 204 (no body) for deletes.
func setStatus(ctx context.Context, w http.ResponseWriter, _ proto.Message) error {
	method, ok := runtime.RPCMethod(ctx)
	if !ok {
		return nil
	}
	name := method[strings.LastIndex(method, "/")+1:]
	switch {
	case strings.HasPrefix(name, "Create"):
		w.WriteHeader(http.StatusCreated)
	case strings.HasPrefix(name, "Delete"):
		w.Header().Del("Content-Type")
		w.WriteHeader(http.StatusNoContent) // grpc-gateway's body write then fails with ErrBodyNotAllowed, which it ignores
	}
	return nil
}

type envelope struct {
	Error struct {
		Code    apierr.Code `json:"code"`
		Message string      `json:"message"`
	} `json:"error"`
}

// WriteError writes the error envelope.
func WriteError(w http.ResponseWriter, status int, code apierr.Code, msg string) {
	var e envelope
	e.Error.Code, e.Error.Message = code, msg
	b, _ := json.MarshalIndent(e, "", "  ")
	w.Header().Set("Content-Type", "application/json")
	w.Header().Del("Content-Length")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

// LimitBody caps request bodies; a larger one is a 400 invalid_request when
// the decoder hits the limit.
func LimitBody(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > MaxBodyBytes {
			WriteError(w, http.StatusBadRequest, apierr.InvalidRequest, fmt.Sprintf("body: larger than %d bytes", MaxBodyBytes))
			return
		}
		if r.Body != nil {
			r.Body = http.MaxBytesReader(w, r.Body, MaxBodyBytes)
		}
		next.ServeHTTP(w, r)
	})
}

// RefuseUncleanPaths answers a path with "." or ".." segments or doubled
// slashes with the contract's not_found envelope. http.ServeMux would
// redirect it (307, method and body kept) to the cleaned path, so
// "POST /api/v1/vms/x/../../networks" would land on another resource.
func RefuseUncleanPaths(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p := r.URL.EscapedPath(); p != "" && p != "*" && p != cleanPath(p) {
			WriteError(w, http.StatusNotFound, apierr.NotFound, fmt.Sprintf("no route %s %s", r.Method, r.URL.Path))
			return
		}
		next.ServeHTTP(w, r)
	})
}

// cleanPath is http.ServeMux's: path.Clean, keeping a trailing slash.
func cleanPath(p string) string {
	if p[0] != '/' {
		p = "/" + p
	}
	np := path.Clean(p)
	if p[len(p)-1] == '/' && np != "/" {
		np += "/"
	}
	return np
}
