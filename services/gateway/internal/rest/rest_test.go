package rest

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestNoRoute: an unknown path, and a known path with a method it does not
// serve, are the original's 404 not_found "no route <METHOD> <path>".
func TestNoRoute(t *testing.T) {
	mux := NewMux(slog.New(slog.NewTextHandler(io.Discard, nil)))
	ok := func(w http.ResponseWriter, _ *http.Request, _ map[string]string) {
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte("{}"))
	}
	if err := mux.HandlePath("GET", "/api/v1/host", ok); err != nil {
		t.Fatal(err)
	}
	if err := mux.HandlePath("DELETE", "/api/v1/vms/{id}", ok); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ method, path string }{
		{"POST", "/api/v1/host"},
		{"DELETE", "/api/v1/host"},
		{"PUT", "/api/v1/vms/0a1b2c3d"},
		{"GET", "/api/v1/nothing"},
		{"POST", "/api/v1/vms/0a1b2c3d/nothing"},
	} {
		w := httptest.NewRecorder()
		mux.ServeHTTP(w, httptest.NewRequest(c.method, "http://x"+c.path, nil))
		var e struct {
			Error struct{ Code, Message string }
		}
		if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || w.Code != 404 || w.Header().Get("Content-Type") != "application/json" {
			t.Errorf("%s %s: %d %q %q", c.method, c.path, w.Code, w.Header().Get("Content-Type"), w.Body.String())
			continue
		}
		if want := "no route " + c.method + " " + c.path; e.Error.Code != "not_found" || e.Error.Message != want {
			t.Errorf("%s %s: %+v, want not_found %q", c.method, c.path, e.Error, want)
		}
	}
	w := httptest.NewRecorder()
	mux.ServeHTTP(w, httptest.NewRequest("GET", "http://x/api/v1/host", nil))
	if w.Code != 200 {
		t.Errorf("GET /api/v1/host: %d %q", w.Code, w.Body.String())
	}
	// HEAD is served by the GET route, without a body, as the original's
	// method patterns did; on a path without a GET it is no route.
	h := HeadAsGet(mux)
	w = httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("HEAD", "http://x/api/v1/host", nil))
	if w.Code != 200 || w.Body.Len() != 0 || w.Header().Get("Content-Type") != "application/json" {
		t.Errorf("HEAD /api/v1/host: %d %q %q", w.Code, w.Header().Get("Content-Type"), w.Body.String())
	}
	w = httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("HEAD", "http://x/api/v1/vms/0a1b2c3d", nil))
	if w.Code != 404 || w.Body.Len() != 0 {
		t.Errorf("HEAD /api/v1/vms/0a1b2c3d: %d %q", w.Code, w.Body.String())
	}
}

// Found by tests/hostile_test.go: GET /api/v1/images/.. was a 307 to
// /api/v1/ (and POST /api/v1/vms/x/../../networks a 307 to /api/v1/networks,
// body kept) instead of the JSON not_found of every unknown path.
func TestRefuseUncleanPaths(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/api/v1/", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("api")) })
	h := RefuseUncleanPaths(mux)
	for _, p := range []string{"/api/v1/images/..", "/api/v1/images/../../etc", "/api/v1//images", "/api/v1/./images", "/api/v1/images/a/..", "/api/v1/vms/x/../../networks", "//api/v1/images"} {
		for _, m := range []string{"GET", "POST", "PUT", "DELETE"} {
			w := httptest.NewRecorder()
			h.ServeHTTP(w, httptest.NewRequest(m, "http://x"+p, nil))
			var e struct {
				Error struct{ Code, Message string }
			}
			if w.Code != 404 || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Code != "not_found" || w.Header().Get("Location") != "" {
				t.Errorf("%s %s: %d %q", m, p, w.Code, w.Body.String())
			}
		}
	}
	for _, p := range []string{"/api/v1/images", "/api/v1/images/", "/api/v1/images/%2e%2e", "/api/v1/images/a..b", "/api/v1/images/..%2Fetc"} {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", "http://x"+p, nil))
		if w.Code != 200 {
			t.Errorf("GET %s: %d %q, want it passed on", p, w.Code, w.Body.String())
		}
	}
}
