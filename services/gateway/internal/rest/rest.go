// Package rest serves the REST API through grpc-gateway with the contract's
// conventions: the restjson shapes, 201 on create, 204 on delete, an 8 MiB
// body limit and the error envelope {"error":{"code","message"}}.
package rest

import (
	"context"
	"log/slog"
	"net/http"
	"path"
	"strings"

	"github.com/giantswarm/vm-manager/sdk/apierr"
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
		// A backend that is down already says so by name (mesh.DialBackend).
		runtime.WithErrorHandler(func(_ context.Context, _ *runtime.ServeMux, _ runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
			code := apierr.CodeOf(err)
			if status := apierr.HTTPStatus(code); status >= 500 {
				log.Error("request failed", "method", r.Method, "path", r.URL.Path, "status", status, "code", code, "error", apierr.MessageOf(err))
			}
			apierr.WriteREST(w, err)
		}),
		// A known path with another method is no route, as in the original
		// (its method patterns fell through to the /api/v1/ catch-all): 404
		// not_found, not 405.
		runtime.WithRoutingErrorHandler(func(_ context.Context, _ *runtime.ServeMux, _ runtime.Marshaler, w http.ResponseWriter, r *http.Request, _ int) {
			NotFound(w, r)
		}),
		runtime.WithForwardResponseOption(setWarnings),
		runtime.WithForwardResponseOption(setStatus),
	)
}

// NotFound answers a path nothing serves with the not_found envelope.
func NotFound(w http.ResponseWriter, r *http.Request) {
	apierr.WriteREST(w, apierr.Errorf(apierr.NotFound, "no route %s %s", r.Method, r.URL.Path))
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

// HeadAsGet answers HEAD on a GET route as the original's method patterns
// did (a GET pattern serves HEAD): the GET's status and headers, no body.
// grpc-gateway routes by exact method and would answer 404.
func HeadAsGet(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodHead {
			next.ServeHTTP(w, r)
			return
		}
		r2 := r.Clone(r.Context())
		r2.Method = http.MethodGet
		next.ServeHTTP(headWriter{w}, r2)
	})
}

// headWriter drops the body; net/http would do so for a HEAD request too,
// but the handler sees a GET.
type headWriter struct{ http.ResponseWriter }

func (h headWriter) Write(b []byte) (int, error) { return len(b), nil }

// LimitBody caps request bodies; a larger one is a 400 invalid_request when
// the decoder hits the limit.
func LimitBody(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > MaxBodyBytes {
			apierr.WriteREST(w, apierr.Errorf(apierr.InvalidRequest, "body: larger than %d bytes", MaxBodyBytes))
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
			NotFound(w, r)
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
