package rest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"google.golang.org/grpc/metadata"
)

// ImportPath is where REST serves ImportImage.
const ImportPath = "/api/v1/images:import"

// Import serves POST /api/v1/images:import (body: ImportImageRequest, in
// the REST request shape) as newline-delimited JSON, the watch's framing
// (Watch): one {"result":{…}} per message in the REST shapes, the last one
// with phase "done" and the image; a failure after the first line is a last
// {"error":{"code","message"}} line, one before it the usual envelope and
// status. grpc-gateway's own stream handler would write each message
// through restjson's Marshaler, which indents (a message over several
// lines) and does not know its {"result":…} wrapper. The import is the
// request's: a client that goes away cancels it, and the hypervisor then
// removes what it wrote.
func Import(hv hypervisorv1.HypervisorServiceClient, log *slog.Logger) http.Handler {
	return LimitBody(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, err := importRequest(r)
		if err != nil {
			apierr.WriteREST(w, err)
			return
		}
		ctx, cancel := context.WithCancel(r.Context())
		defer cancel()
		if a := r.Header.Get("Authorization"); a != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "authorization", a)
		}
		stream, err := hv.ImportImage(ctx, req)
		if err != nil {
			apierr.WriteREST(w, err)
			return
		}
		rc := http.NewResponseController(w)
		started := false
		for {
			msg, err := stream.Recv()
			if err == io.EOF {
				return
			}
			if err != nil {
				if r.Context().Err() != nil {
					return // the client left
				}
				if apierr.HTTPStatus(apierr.CodeOf(err)) >= 500 {
					log.Error("image import failed", "source", req.GetSource(), "code", apierr.CodeOf(err), "error", apierr.MessageOf(err))
				}
				if !started {
					apierr.WriteREST(w, err)
					return
				}
				writeStreamError(w, false, err)
				_ = rc.Flush()
				return
			}
			if !started {
				started = true
				h := w.Header()
				h.Set("Content-Type", contentType(false))
				h.Set("Cache-Control", "no-store")
				h.Set("X-Accel-Buffering", "no") // nginx: do not hold the progress back
				w.WriteHeader(http.StatusOK)
			}
			body, err := compact(restjson.Marshal(msg))
			if err != nil {
				writeStreamError(w, false, apierr.Errorf(apierr.Internal, "encoding the message: %v", err))
				return
			}
			if _, err := fmt.Fprintf(w, "{\"result\":%s}\n", body); err != nil {
				return
			}
			if err := rc.Flush(); err != nil {
				return
			}
		}
	}))
}

// importRequest reads the body as grpc-gateway reads a body "*": the REST
// request shape (snake_case or camelCase, unknown fields refused); an empty
// body is an empty request, which the hypervisor refuses for its missing
// source.
func importRequest(r *http.Request) (*hypervisorv1.ImportImageRequest, error) {
	req := &hypervisorv1.ImportImageRequest{}
	for k := range r.URL.Query() {
		return nil, apierr.Errorf(apierr.InvalidRequest, "unknown query parameter %.64q: the import's fields (node included) go in the body", k)
	}
	err := restjson.Marshaler{}.NewDecoder(r.Body).Decode(req)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, apierr.Errorf(apierr.InvalidRequest, "%v", err)
	}
	return req, nil
}
