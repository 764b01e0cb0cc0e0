package rest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"mime"
	"net/http"
	"strconv"
	"strings"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/sdk/enumname"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"google.golang.org/grpc/metadata"
)

// WatchPath is where REST serves WatchVirtualMachines.
const WatchPath = "/api/v1/vms:watch"

// Watch serves GET /api/v1/vms:watch (query: id, name, since_revision) as
// newline-delimited JSON, grpc-gateway's stream framing: one
// {"result":{…}} per message and, when the stream fails after it began, a
// last {"error":{"code","message"}}. With Accept: text/event-stream it
// serves Server-Sent Events instead: "event:" the message type, "data:" the
// message, "id:" its revision on every message one can resume after (all but
// SNAPSHOT), so a browser's EventSource resumes with Last-Event-ID. An error
// before the first message is the usual envelope and status. Streams end
// with unavailable when drain ends (the gateway shutting down), naming the
// revision to resume from.
func Watch(hv hypervisorv1.HypervisorServiceClient, drain context.Context, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req, err := watchRequest(r)
		if err != nil {
			apierr.WriteREST(w, err)
			return
		}
		sse := acceptsEventStream(r.Header.Get("Accept"))
		if r.Method == http.MethodHead { // the stream's headers, not a stream without end
			w.Header().Set("Content-Type", contentType(sse))
			w.WriteHeader(http.StatusOK)
			return
		}
		ctx, cancel := context.WithCancel(r.Context())
		defer cancel()
		stop := context.AfterFunc(drain, cancel)
		defer stop()
		if a := r.Header.Get("Authorization"); a != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "authorization", a)
		}
		stream, err := hv.WatchVirtualMachines(ctx, req)
		if err != nil {
			apierr.WriteREST(w, err)
			return
		}
		rc := http.NewResponseController(w)
		started := false
		resume := req.GetSinceRevision() // the revision a client resumes from
		for {
			msg, err := stream.Recv()
			if err != nil {
				if r.Context().Err() != nil {
					return // the client left
				}
				if drain.Err() != nil {
					err = apierr.Errorf(apierr.Unavailable, "the gateway is shutting down; watch again with since_revision %d", resume)
				}
				if !started {
					apierr.WriteREST(w, err)
					return
				}
				writeStreamError(w, sse, err)
				_ = rc.Flush()
				if apierr.HTTPStatus(apierr.CodeOf(err)) >= 500 {
					log.Warn("watch stream ended", "error", apierr.MessageOf(err))
				}
				return
			}
			if !started {
				started = true
				h := w.Header()
				h.Set("Content-Type", contentType(sse))
				h.Set("Cache-Control", "no-store")
				h.Set("X-Accel-Buffering", "no") // nginx: do not hold the stream back
				w.WriteHeader(http.StatusOK)
			}
			if msg.GetType() != hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT {
				resume = msg.GetRevision()
			}
			if err := writeMessage(w, sse, msg); err != nil {
				return
			}
			// Every message goes out at once: a watch is read live.
			if err := rc.Flush(); err != nil {
				return
			}
		}
	})
}

// watchRequest reads the query; unknown or repeated parameters and bad
// revisions are invalid_request (id and name are checked by the hypervisor).
func watchRequest(r *http.Request) (*hypervisorv1.WatchVirtualMachinesRequest, error) {
	req := &hypervisorv1.WatchVirtualMachinesRequest{}
	since := ""
	for k, v := range r.URL.Query() {
		if len(v) != 1 {
			return nil, apierr.Errorf(apierr.InvalidRequest, "query parameter %.64q given %d times", k, len(v))
		}
		switch k {
		case "id":
			req.Id = v[0]
		case "name":
			req.Name = v[0]
		case "since_revision", "sinceRevision":
			since = v[0]
		default:
			return nil, apierr.Errorf(apierr.InvalidRequest, "unknown query parameter %.64q (id, name, since_revision)", k)
		}
	}
	if since == "" {
		since = r.Header.Get("Last-Event-ID") // an EventSource reconnecting
	}
	if since != "" {
		n, err := strconv.ParseUint(since, 10, 64)
		if err != nil {
			return nil, apierr.Errorf(apierr.InvalidRequest, "since_revision %.64q is not a revision (a decimal number)", since)
		}
		req.SinceRevision = n
	}
	return req, nil
}

func contentType(sse bool) string {
	if sse {
		return "text/event-stream"
	}
	return "application/x-ndjson"
}

// acceptsEventStream says whether Accept asks for text/event-stream.
func acceptsEventStream(accept string) bool {
	for part := range strings.SplitSeq(accept, ",") {
		if t, _, err := mime.ParseMediaType(strings.TrimSpace(part)); err == nil && t == "text/event-stream" {
			return true
		}
	}
	return false
}

func writeMessage(w http.ResponseWriter, sse bool, msg *hypervisorv1.WatchVirtualMachinesResponse) error {
	body, err := compact(restjson.Marshal(msg))
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	if sse {
		if msg.GetType() != hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT {
			fmt.Fprintf(&buf, "id: %d\n", msg.GetRevision())
		}
		fmt.Fprintf(&buf, "event: %s\ndata: %s\n\n", enumname.Of(msg.GetType()), body)
	} else {
		fmt.Fprintf(&buf, "{\"result\":%s}\n", body)
	}
	_, err = w.Write(buf.Bytes())
	return err
}

func writeStreamError(w http.ResponseWriter, sse bool, err error) {
	body, cerr := compact(apierr.RESTBody(err), nil)
	if cerr != nil {
		return
	}
	if sse {
		fmt.Fprintf(w, "event: error\ndata: %s\n\n", body)
		return
	}
	fmt.Fprintf(w, "%s\n", body)
}

// compact puts JSON on one line: a line is a message in both framings.
func compact(b []byte, err error) ([]byte, error) {
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
