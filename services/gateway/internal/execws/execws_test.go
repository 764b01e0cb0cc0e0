package execws

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestLiftToken(t *testing.T) {
	var got *http.Request
	h := LiftToken(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { got = r }))
	serve := func(hdr http.Header) *http.Request {
		r := httptest.NewRequest("GET", "/api/v1/vms/a/exec/ws", nil)
		r.Header = hdr
		h.ServeHTTP(httptest.NewRecorder(), r)
		return got
	}
	// A browser's upgrade: the token moves into Authorization and out of
	// the list the server answers from.
	r := serve(http.Header{"Upgrade": {"websocket"}, "Sec-Websocket-Protocol": {"vmm.exec.v1, bearer.abc.def-ghi"}})
	if r.Header.Get("Authorization") != "Bearer abc.def-ghi" || r.Header.Get("Sec-WebSocket-Protocol") != "vmm.exec.v1" {
		t.Errorf("lifted: %q, protocols %q", r.Header.Get("Authorization"), r.Header.Get("Sec-WebSocket-Protocol"))
	}
	// An Authorization header wins; the list is left alone.
	r = serve(http.Header{"Upgrade": {"websocket"}, "Authorization": {"Bearer h"}, "Sec-Websocket-Protocol": {"vmm.exec.v1, bearer.x"}})
	if r.Header.Get("Authorization") != "Bearer h" {
		t.Errorf("header replaced: %q", r.Header.Get("Authorization"))
	}
	// Not an upgrade: nothing is read from the header.
	r = serve(http.Header{"Sec-Websocket-Protocol": {"bearer.x"}})
	if r.Header.Get("Authorization") != "" {
		t.Errorf("lifted from a plain request: %q", r.Header.Get("Authorization"))
	}
}

func TestOffers(t *testing.T) {
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Add("Sec-WebSocket-Protocol", "a, vmm.exec.v1x")
	if offers(r, Subprotocol) {
		t.Error("a prefix matched")
	}
	r.Header.Add("Sec-WebSocket-Protocol", "b,vmm.exec.v1")
	if !offers(r, Subprotocol) {
		t.Error("not found in the second header")
	}
}
