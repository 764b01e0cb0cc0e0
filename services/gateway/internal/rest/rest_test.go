package rest

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
)

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
