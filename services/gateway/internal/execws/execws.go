// Package execws serves ExecVirtualMachineStream as a WebSocket next to
// REST, at GET /api/v1/vms/{id}/exec/ws, subprotocol vmm.exec.v1
// (docs/api.md):
//
//   - the client's first message (text or binary) is the JSON of an
//     ExecVirtualMachineStreamRequest with "start" (the id comes from the
//     path); then binary messages are stdin, text messages JSON requests
//     ("resize", "signal", "stdinClose", or "stdin" in base64);
//   - the server sends binary messages whose first byte names the stream (1
//     stdout, 2 stderr), and last a text message {"exit":{…}} or the REST
//     error envelope {"error":{"code","message"}}, then closes.
//
// Browsers cannot set an Authorization header on a WebSocket: a token may
// come as the subprotocol "bearer.<token>" instead (LiftToken), never as a
// cookie, so a page can use only a token it holds. Origin is judged by the
// cross-site guard in front (xsite), as for REST.
package execws

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"

	"github.com/coder/websocket"
	"google.golang.org/protobuf/encoding/protojson"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Subprotocol is the protocol the client must offer.
const Subprotocol = "vmm.exec.v1"

// TokenPrefix marks a bearer token in the Sec-WebSocket-Protocol list.
const TokenPrefix = "bearer."

// Stream bytes that prefix the server's binary messages.
const (
	StreamStdout byte = 1
	StreamStderr byte = 2
)

// MaxMessage bounds one client message (stdin chunk or JSON request).
const MaxMessage = 1 << 20

// Path is the route on the gateway's mux.
const Path = "GET /api/v1/vms/{id}/exec/ws"

// Handler bridges each WebSocket to one ExecVirtualMachineStream call on
// the hypervisor, with the request's context (so the caller's token goes
// along).
func Handler(client hypervisorv1.HypervisorServiceClient, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
			w.Header().Set("Upgrade", "websocket")
			apierr.WriteRESTStatus(w, http.StatusUpgradeRequired, apierr.Errorf(apierr.InvalidRequest, "this endpoint speaks WebSocket with subprotocol %s (docs/api.md)", Subprotocol))
			return
		}
		if !offers(r, Subprotocol) {
			apierr.WriteREST(w, apierr.Invalidf("Sec-WebSocket-Protocol", "offer the subprotocol %s", Subprotocol))
			return
		}
		// Origin is the cross-site guard's (xsite), in front of this handler.
		c, err := websocket.Accept(w, r, &websocket.AcceptOptions{Subprotocols: []string{Subprotocol}, InsecureSkipVerify: true})
		if err != nil {
			return // Accept answered
		}
		c.SetReadLimit(MaxMessage)
		s := &session{c: c, log: log}
		s.serve(r.Context(), client, r.PathValue("id"))
	})
}

// offers reports whether the request lists proto in Sec-WebSocket-Protocol.
func offers(r *http.Request, proto string) bool {
	for _, h := range r.Header.Values("Sec-WebSocket-Protocol") {
		for p := range strings.SplitSeq(h, ",") {
			if strings.TrimSpace(p) == proto {
				return true
			}
		}
	}
	return false
}

// LiftToken moves a "bearer.<token>" subprotocol of a WebSocket upgrade into
// the Authorization header, for the identity guard behind it, unless the
// request has one. The token is taken out of the list: the server never
// echoes it.
func LiftToken(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "" || !strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
			next.ServeHTTP(w, r)
			return
		}
		var keep []string
		token := ""
		for _, h := range r.Header.Values("Sec-WebSocket-Protocol") {
			for p := range strings.SplitSeq(h, ",") {
				p = strings.TrimSpace(p)
				if t, ok := strings.CutPrefix(p, TokenPrefix); ok && token == "" {
					token = t
					continue
				}
				if p != "" {
					keep = append(keep, p)
				}
			}
		}
		if token != "" {
			r = r.Clone(r.Context())
			r.Header.Set("Authorization", "Bearer "+token)
			r.Header.Set("Sec-WebSocket-Protocol", strings.Join(keep, ", "))
		}
		next.ServeHTTP(w, r)
	})
}

type session struct {
	c   *websocket.Conn
	log *slog.Logger
}

// fail sends the error envelope and closes.
func (s *session) fail(ctx context.Context, err error) {
	_ = s.c.Write(ctx, websocket.MessageText, apierr.RESTBody(err))
	_ = s.c.Close(websocket.StatusNormalClosure, string(apierr.CodeOf(err)))
}

func (s *session) serve(ctx context.Context, client hypervisorv1.HypervisorServiceClient, id string) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer s.c.CloseNow()

	_, data, err := s.c.Read(ctx)
	if err != nil {
		return
	}
	first := &hypervisorv1.ExecVirtualMachineStreamRequest{}
	if err := protojson.Unmarshal(data, first); err != nil || first.GetStart() == nil {
		s.fail(ctx, apierr.Invalidf("start", "the first message must be the JSON {\"start\":{\"command\":[…],\"pty\":{…}}}"))
		return
	}
	st := first.GetStart()
	if st.GetId() != "" && st.GetId() != id {
		s.fail(ctx, apierr.Invalidf("start.id", "start.id %q differs from the path's %q", st.GetId(), id))
		return
	}
	st.Id = id

	stream, err := client.ExecVirtualMachineStream(ctx)
	if err == nil {
		err = stream.Send(first)
	}
	if err != nil {
		s.fail(ctx, apierr.FromStatus(err))
		return
	}
	go s.input(ctx, cancel, stream)
	for {
		resp, err := stream.Recv()
		if err != nil {
			if ctx.Err() == nil { // not the client that went away
				s.fail(ctx, apierr.FromStatus(err))
			}
			return
		}
		switch k := resp.GetKind().(type) {
		case *hypervisorv1.ExecVirtualMachineStreamResponse_Stdout:
			err = s.c.Write(ctx, websocket.MessageBinary, append([]byte{StreamStdout}, k.Stdout...))
		case *hypervisorv1.ExecVirtualMachineStreamResponse_Stderr:
			err = s.c.Write(ctx, websocket.MessageBinary, append([]byte{StreamStderr}, k.Stderr...))
		case *hypervisorv1.ExecVirtualMachineStreamResponse_Exit:
			b, _ := protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(resp)
			if s.c.Write(ctx, websocket.MessageText, b) == nil {
				_ = s.c.Close(websocket.StatusNormalClosure, "exit")
			}
			return
		}
		// Write waits while the browser does not read: the hypervisor's
		// stream, and with it the guest's command, wait too.
		if err != nil {
			return
		}
	}
}

// input forwards the client's messages; the client closing the WebSocket
// ends the session (its stdin ends with a "stdinClose" request).
func (s *session) input(ctx context.Context, cancel context.CancelFunc, stream hypervisorv1.HypervisorService_ExecVirtualMachineStreamClient) {
	for {
		typ, data, err := s.c.Read(ctx)
		if err != nil {
			cancel()
			return
		}
		req := &hypervisorv1.ExecVirtualMachineStreamRequest{}
		if typ == websocket.MessageBinary {
			req.Kind = &hypervisorv1.ExecVirtualMachineStreamRequest_Stdin{Stdin: data}
		} else if err := protojson.Unmarshal(data, req); err != nil {
			s.fail(ctx, apierr.Invalidf("message", "a text message must be the JSON of a request (resize, signal, stdinClose, stdin): %v", err))
			cancel()
			return
		}
		if err := stream.Send(req); err != nil {
			if !errors.Is(err, context.Canceled) {
				s.log.Debug("exec stream send", "error", err)
			}
			return // the hypervisor ended the call: Recv says why
		}
	}
}
