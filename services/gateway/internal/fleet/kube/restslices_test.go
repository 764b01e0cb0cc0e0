package kube

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
)

// apiServer is the EndpointSlice list and watch of an API server, as JSON
// over HTTP: a port fake for the in-cluster client's requests and decoding.
type apiServer struct {
	mu       sync.Mutex
	requests []string
	events   chan metav1.WatchEvent
}

func (a *apiServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	a.requests = append(a.requests, r.Method+" "+r.URL.Path+"?"+r.URL.RawQuery)
	a.mu.Unlock()
	if r.URL.Path != "/apis/discovery.k8s.io/v1/namespaces/"+testNS+"/endpointslices" || r.URL.Query().Get("labelSelector") != "kubernetes.io/service-name="+testSvc {
		w.WriteHeader(http.StatusNotFound)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if r.URL.Query().Get("watch") != "true" {
		s := slice("vmm-nodes-a", grpcPort, ep("vmm-node-0", "10.0.0.1", true))
		s.ResourceVersion = "5"
		list := discoveryv1.EndpointSliceList{TypeMeta: metav1.TypeMeta{Kind: "EndpointSliceList", APIVersion: "discovery.k8s.io/v1"},
			ListMeta: metav1.ListMeta{ResourceVersion: "5"}, Items: []discoveryv1.EndpointSlice{*s}}
		json.NewEncoder(w).Encode(list)
		return
	}
	w.(http.Flusher).Flush()
	for {
		select {
		case <-r.Context().Done():
			return
		case ev := <-a.events:
			json.NewEncoder(w).Encode(ev)
			w.(http.Flusher).Flush()
		}
	}
}

// The in-cluster client lists and watches the Service's slices in its
// namespace with the label selector, and decodes both.
func TestRESTSlices(t *testing.T) {
	api := &apiServer{events: make(chan metav1.WatchEvent, 4)}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close) // after the discovery's cleanup ends its watch
	client, err := newRESTSlices(&rest.Config{Host: srv.URL}, testNS)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testCfg
	cfg.Debounce = 1
	d, err := New(client, cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	r := runDiscovery(t, d)
	expect(t, r, "vmm-node-0=0@10.0.0.1:8443/true")

	s := slice("vmm-nodes-b", grpcPort, ep("vmm-node-1", "10.0.0.2", false))
	s.ResourceVersion = "6"
	s.APIVersion, s.Kind = "discovery.k8s.io/v1", "EndpointSlice"
	raw, _ := json.Marshal(s)
	api.events <- metav1.WatchEvent{Type: "ADDED", Object: runtime.RawExtension{Raw: raw}}
	expect(t, r, "vmm-node-0=0@10.0.0.1:8443/true vmm-node-1=1@10.0.0.2:8443/false")
	api.mu.Lock()
	defer api.mu.Unlock()
	if len(api.requests) < 2 {
		t.Fatalf("requests %q", api.requests)
	}
	for _, req := range api.requests {
		t.Log(req)
	}
	if want := fmt.Sprintf("GET /apis/discovery.k8s.io/v1/namespaces/%s/endpointslices?", testNS); !strings.HasPrefix(api.requests[0], want) {
		t.Errorf("first request %q", api.requests[0])
	}
}
