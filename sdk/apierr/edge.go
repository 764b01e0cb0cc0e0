package apierr

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// The encodings of an error at the edges that are not gRPC: the REST error
// envelope, the MCP tool error text, and the statuses of the IMDS. Every
// surface writes its errors through these, so the code and message a caller
// sees are the same everywhere.

// envelope is the REST error body.
type envelope struct {
	Error struct {
		Code    Code   `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// RESTBody is the REST error envelope of err, {"error":{"code","message"}}
// with the code and message of CodeOf and MessageOf, indented with two
// spaces and ending in a newline like every REST body.
func RESTBody(err error) []byte {
	var e envelope
	e.Error.Code, e.Error.Message = CodeOf(err), MessageOf(err)
	b, _ := json.MarshalIndent(e, "", "  ") // a struct of two strings: cannot fail
	return append(b, '\n')
}

// WriteREST answers err the REST way: the HTTPStatus of its code and the
// RESTBody. A Content-Length set earlier is dropped.
func WriteREST(w http.ResponseWriter, err error) {
	WriteRESTStatus(w, HTTPStatus(CodeOf(err)), err)
}

// WriteRESTStatus is WriteREST with a status other than the code's, for the
// answers whose status says more than the code (405 for a method that a
// path does not allow is an invalid_request).
func WriteRESTStatus(w http.ResponseWriter, status int, err error) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Del("Content-Length")
	w.WriteHeader(status)
	_, _ = w.Write(RESTBody(err))
}

// MCPText is the text of an MCP tool error: "<code>: <message>".
func MCPText(err error) string {
	return fmt.Sprintf("%s: %s", CodeOf(err), MessageOf(err))
}

// IMDSStatus is the status the IMDS answers a guest's failed quote
// submission with (contract §5.2): invalid_request, not_found and conflict
// keep their REST statuses (400, 404, 409); every other code is 500, the
// detail kept in the host's log. A quote that was checked and rejected is
// not an error but a verdict, answered 403 with the verdict as the body.
func IMDSStatus(c Code) int {
	switch c {
	case InvalidRequest, NotFound, Conflict:
		return HTTPStatus(c)
	}
	return http.StatusInternalServerError
}
