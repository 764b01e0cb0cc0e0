package apierr_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestRESTBody(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"domain error", apierr.Errorf(apierr.NotFound, "vm %q not found", "x"),
			"{\n  \"error\": {\n    \"code\": \"not_found\",\n    \"message\": \"vm \\\"x\\\" not found\"\n  }\n}\n"},
		{"backend status", apierr.ToStatus(apierr.Errorf(apierr.Conflict, "network in use")).Err(),
			"{\n  \"error\": {\n    \"code\": \"conflict\",\n    \"message\": \"network in use\"\n  }\n}\n"},
		{"plain status", status.Error(codes.Unavailable, "connection refused"),
			"{\n  \"error\": {\n    \"code\": \"unavailable\",\n    \"message\": \"connection refused\"\n  }\n}\n"},
		// encoding/json's HTML escaping, as the envelope always had.
		{"escaped", apierr.Errorf(apierr.InvalidRequest, "<a&b>"),
			"{\n  \"error\": {\n    \"code\": \"invalid_request\",\n    \"message\": \"\\u003ca\\u0026b\\u003e\"\n  }\n}\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := string(apierr.RESTBody(tc.err)); got != tc.want {
				t.Errorf("RESTBody = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestWriteREST(t *testing.T) {
	w := httptest.NewRecorder()
	w.Header().Set("Content-Length", "12")
	err := apierr.Errorf(apierr.Unavailable, "the hypervisor service is unavailable: down")
	apierr.WriteREST(w, err)
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Content-Type") != "application/json" || w.Header().Get("Content-Length") != "" {
		t.Errorf("WriteREST: %d %v", w.Code, w.Header())
	}
	if w.Body.String() != string(apierr.RESTBody(err)) {
		t.Errorf("WriteREST body %q", w.Body.String())
	}
	w = httptest.NewRecorder()
	apierr.WriteRESTStatus(w, http.StatusMethodNotAllowed, apierr.Errorf(apierr.InvalidRequest, "method PUT is not allowed"))
	if w.Code != http.StatusMethodNotAllowed || w.Body.String() != "{\n  \"error\": {\n    \"code\": \"invalid_request\",\n    \"message\": \"method PUT is not allowed\"\n  }\n}\n" {
		t.Errorf("WriteRESTStatus: %d %q", w.Code, w.Body.String())
	}
}

func TestMCPText(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{apierr.Errorf(apierr.NotFound, "vm %q not found", "x"), `not_found: vm "x" not found`},
		{apierr.ToStatus(apierr.Errorf(apierr.Timeout, "slow")).Err(), "timeout: slow"},
		{status.Error(codes.PermissionDenied, "no"), "forbidden: no"},
	} {
		if got := apierr.MCPText(tc.err); got != tc.want {
			t.Errorf("MCPText = %q, want %q", got, tc.want)
		}
	}
}

// The IMDS's statuses are contract §5.2's, not REST's: only invalid, not
// found and conflict are told apart.
func TestIMDSStatus(t *testing.T) {
	want := map[apierr.Code]int{
		apierr.InvalidRequest: 400,
		apierr.NotFound:       404,
		apierr.Conflict:       409,
	}
	for _, c := range append(apierr.Codes, "something_else") {
		w, ok := want[c]
		if !ok {
			w = 500
		}
		if got := apierr.IMDSStatus(c); got != w {
			t.Errorf("IMDSStatus(%q) = %d, want %d", c, got, w)
		}
	}
}
