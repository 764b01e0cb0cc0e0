package sysext

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-tpm/tpm2"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/guest/internal/pcrextend"
	"github.com/giantswarm/vm-manager/guest/internal/swtpmtest"
	"github.com/giantswarm/vm-manager/pkg/measure"
)

// fakeMerge stands in for the loop mount: it records the call and puts the
// extension-release file where the mounted image would have it.
type fakeMerge struct {
	merged    []string
	unmerged  []string
	versionID string // "" → no extension-release: not a sysext
}

func (f *fakeMerge) Merge(image, dir string) error {
	f.merged = append(f.merged, image+" "+dir)
	if f.versionID == "" {
		return nil
	}
	rel := filepath.Join(dir, "usr/lib/extension-release.d", "extension-release."+filepath.Base(dir))
	os.MkdirAll(filepath.Dir(rel), 0o755)
	return os.WriteFile(rel, []byte("ID=_any\nVERSION_ID="+f.versionID+"\n"), 0o644)
}

func (f *fakeMerge) Unmerge(dir string) error {
	f.unmerged = append(f.unmerged, dir)
	return nil
}

// host is the IMDS's sysupdate side: a version, SHA256SUMS and the image.
type host struct {
	version string // "" → 404
	image   []byte
	listed  string // SHA256SUMS' hash for the image; its real one when ""
}

func (h *host) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /giantswarm/v1/kubernetes-version", func(w http.ResponseWriter, r *http.Request) {
		if h.version == "" {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte(h.version + "\n"))
	})
	mux.HandleFunc("GET /giantswarm/v1/sysupdate/kubernetes/SHA256SUMS", func(w http.ResponseWriter, r *http.Request) {
		listed := h.listed
		if listed == "" {
			listed = hexSum(h.image)
		}
		fmt.Fprintf(w, "%s  kubernetes_1.30.4.raw\n%s  kubernetes_1.31.1.raw\n", strings.Repeat("ab", 32), listed)
	})
	mux.HandleFunc("GET /giantswarm/v1/sysupdate/kubernetes/kubernetes_1.31.1.raw", func(w http.ResponseWriter, r *http.Request) {
		w.Write(h.image)
	})
	return mux
}

func hexSum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

type run struct {
	res     Result
	merge   *fakeMerge
	dir     string
	logPath string
	sock    string
	out     string
}

func runSysext(t *testing.T, h *host, max int64) *run {
	t.Helper()
	srv := httptest.NewServer(h.handler())
	t.Cleanup(srv.Close)
	sw := swtpmtest.Start(t, "")
	tmp := t.TempDir()
	r := &run{merge: &fakeMerge{versionID: "1.31.1"}, dir: filepath.Join(tmp, "run/extensions"),
		logPath: filepath.Join(tmp, "tpm2-measure.log"), sock: sw.Socket()}
	var out strings.Builder
	r.res = Run(context.Background(), Config{
		IMDS:     imdsclient.New(srv.URL + "/giantswarm/v1"),
		Measure:  &pcrextend.Extender{TPMPath: sw.Socket(), LogPath: r.logPath},
		Merge:    r.merge,
		Dir:      r.dir,
		MaxBytes: max,
		Logf:     func(f string, a ...any) { fmt.Fprintf(&out, f+"\n", a...) },
	})
	r.out = out.String()
	t.Logf("console:\n%s", r.out)
	return r
}

// pcr13 is PCR 13 and the log's replay; the log must parse.
func (r *run) pcr13(t *testing.T) (pcr, replay []byte, evs []measure.Event) {
	t.Helper()
	tpm, err := attest.OpenTPM(r.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close()
	v, err := attest.ReadPCRs(tpm, tpm2.TPMAlgSHA256, []uint{13})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(r.logPath)
	if evs, err = measure.ParseLog(b); err != nil {
		t.Fatal(err)
	}
	return v[13], measure.Replay(evs), evs
}

var image = bytes.Repeat([]byte("erofs image "), 1000)

func TestSysextMatchIsMeasuredAndMerged(t *testing.T) {
	r := runSysext(t, &host{version: "1.31.1", image: image}, 0)
	sum := hexSum(image)
	if r.res != (Result{Version: "1.31.1", State: StateMerged, SHA256: sum, Listed: sum, VersionID: "1.31.1"}) {
		t.Errorf("result %+v", r.res)
	}
	pcr, replay, evs := r.pcr13(t)
	line := sum + "  kubernetes_1.31.1.raw"
	if !bytes.Equal(pcr, measure.PCR13(line)) || !bytes.Equal(pcr, replay) {
		t.Errorf("PCR 13 %x, rule %x, log %x", pcr, measure.PCR13(line), replay)
	}
	if len(evs) != 2 || evs[0].Description != `os-separator "os-separator"` || evs[1].Description != fmt.Sprintf("sysext %q", line) {
		t.Errorf("log events %+v", evs)
	}
	img := filepath.Join(r.dir, "kubernetes_1.31.1.raw")
	if len(r.merge.merged) != 1 || r.merge.merged[0] != img+" "+filepath.Join(r.dir, "kubernetes_1.31.1") {
		t.Errorf("merges %q", r.merge.merged)
	}
	if b, err := os.ReadFile(img); err != nil || !bytes.Equal(b, image) {
		t.Errorf("image on disk: %v", err)
	}
	if !strings.Contains(r.out, "sysext kubernetes_1.31.1.raw merged (VERSION_ID=1.31.1)\n") {
		t.Error("no merged line")
	}
}

// A different image than SHA256SUMS lists is measured (PCR 13 shows what
// was fetched) but not merged, and not kept.
func TestSysextMismatchMeasuredNotMerged(t *testing.T) {
	listed := hexSum([]byte("the image the host built"))
	r := runSysext(t, &host{version: "1.31.1", image: image, listed: listed}, 0)
	if r.res.State != StateMismatch || r.res.SHA256 != hexSum(image) || r.res.Listed != listed {
		t.Errorf("result %+v", r.res)
	}
	pcr, replay, _ := r.pcr13(t)
	if want := measure.PCR13(hexSum(image) + "  kubernetes_1.31.1.raw"); !bytes.Equal(pcr, want) || !bytes.Equal(pcr, replay) {
		t.Errorf("PCR 13 %x, want %x, log %x", pcr, want, replay)
	}
	if len(r.merge.merged) != 0 {
		t.Errorf("merged %q", r.merge.merged)
	}
	if ents, _ := os.ReadDir(r.dir); len(ents) != 0 {
		t.Errorf("left in %s: %v", r.dir, ents)
	}
	if !strings.Contains(r.out, "not merged: fetched sha256 "+hexSum(image)+", SHA256SUMS lists "+listed) {
		t.Error("no reason printed")
	}
}

func TestSysextNoVersionSkipped(t *testing.T) {
	r := runSysext(t, &host{image: image}, 0)
	if r.res != (Result{State: StateNone}) {
		t.Errorf("result %+v", r.res)
	}
	if pcr, _, evs := r.pcr13(t); !bytes.Equal(pcr, measure.Zero()) || len(evs) != 0 {
		t.Errorf("PCR 13 %x, %d log events", pcr, len(evs))
	}
	if len(r.merge.merged) != 0 || !strings.Contains(r.out, "no kubernetes version (404)") {
		t.Errorf("merged %q", r.merge.merged)
	}
}

// An image over the bound is not read past it, not kept, not measured.
func TestSysextOversizedRefused(t *testing.T) {
	r := runSysext(t, &host{version: "1.31.1", image: image}, int64(len(image)-1))
	if r.res.State != StateRefused || r.res.SHA256 != "" {
		t.Errorf("result %+v", r.res)
	}
	if pcr, _, evs := r.pcr13(t); !bytes.Equal(pcr, measure.Zero()) || len(evs) != 0 {
		t.Errorf("PCR 13 %x, %d log events", pcr, len(evs))
	}
	if ents, _ := os.ReadDir(r.dir); len(r.merge.merged) != 0 || len(ents) != 0 {
		t.Errorf("merged %q, left %v", r.merge.merged, ents)
	}
	if !strings.Contains(r.out, "sysext kubernetes_1.31.1.raw: refused: larger than the 11999-byte bound") {
		t.Error("no bound printed")
	}
}

// An image without extension-release is unmounted again.
func TestSysextNotAnExtension(t *testing.T) {
	srv := httptest.NewServer((&host{version: "1.31.1", image: image}).handler())
	t.Cleanup(srv.Close)
	sw := swtpmtest.Start(t, "")
	m := &fakeMerge{}
	dir := t.TempDir()
	res := Run(context.Background(), Config{IMDS: imdsclient.New(srv.URL + "/giantswarm/v1"),
		Measure: &pcrextend.Extender{TPMPath: sw.Socket(), LogPath: filepath.Join(dir, "log")}, Merge: m, Dir: dir})
	if res.State != StateFailed || len(m.unmerged) != 1 {
		t.Errorf("result %+v, unmerged %q", res, m.unmerged)
	}
}

func TestLookup(t *testing.T) {
	a, b := strings.Repeat("ab", 32), strings.Repeat("CD", 32)
	sums := []byte(a + "  kubernetes_1.30.4.raw\n" + b + " *kubernetes_1.31.1.raw\nnonsense\n")
	if got, err := Lookup(sums, "kubernetes_1.31.1.raw"); err != nil || got != strings.ToLower(b) {
		t.Errorf("%q %v", got, err)
	}
	if _, err := Lookup(sums, "kubernetes_1.29.0.raw"); err == nil || err.Error() != "SHA256SUMS lists no kubernetes_1.29.0.raw" {
		t.Errorf("%v", err)
	}
	if _, err := Lookup([]byte("xyz  kubernetes_1.31.1.raw\n"), "kubernetes_1.31.1.raw"); err == nil {
		t.Error("bad hash accepted")
	}
}

func TestBadVersionRefused(t *testing.T) {
	srv := httptest.NewServer((&host{version: "../../etc"}).handler())
	t.Cleanup(srv.Close)
	res := Run(context.Background(), Config{IMDS: imdsclient.New(srv.URL + "/giantswarm/v1"), Dir: t.TempDir()})
	if res.State != StateFailed || res.Version != "" {
		t.Errorf("result %+v", res)
	}
}
