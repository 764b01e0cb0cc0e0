package tests

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// BenchmarkOCIImage measures, in one run, the import of a ~100 MB OCI
// image (Debian's python3 and 64 MiB of incompressible data, from a
// registry on loopback: layers read, flattened, erofs and dm-verity written,
// one measuring boot) and the create→ready of its VMs beside the test
// guest's, interleaved, with the ratio. Run it with a fixed count: -benchtime 2x.
func BenchmarkOCIImage(b *testing.B) {
	dir := ociImageDir(b)
	rootfs := pythonRootfs(b)
	host := ociRegistry(b)
	tmp := b.TempDir()
	rootTar := filepath.Join(tmp, "rootfs.tar")
	tarDir(b, rootfs, rootTar)
	baseLayer, err := tarball.LayerFromFile(rootTar)
	if err != nil {
		b.Fatal(err)
	}
	noise := make([]byte, 64<<20)
	rand.Read(noise)
	noiseLayer := filesLayer(b, map[string]string{"data/noise.bin": string(noise)})
	cfg := v1.Config{Cmd: []string{"python3", "-c", "import time; time.sleep(1e6)"}, Env: []string{"PATH=/usr/bin:/bin"}}
	pushImage(b, host+"/bench:1", cfg, baseLayer, noiseLayer)
	var layerBytes int64
	for _, l := range []v1.Layer{baseLayer, noiseLayer} {
		n, _ := l.Size()
		layerBytes += n
	}

	c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{ImageDir: dir, Quiet: true})
	base := "http://" + c.Addr + "/api/v1"
	b.Cleanup(func() { killVMsAt(b, base) })

	n := 0
	ready := func(image string) time.Duration {
		n++
		start := time.Now()
		code, _, out := cluster.Do(b, "POST", base+"/vms", fmt.Sprintf(`{"name":"bench-%d","image":%q,"require_attestation":false,"memory_mib":512,"cpus":1,"wait_for":"ready"}`, n, image))
		d := time.Since(start)
		var v struct{ ID, State, LastError string }
		if code != 201 || json.Unmarshal(out, &v) != nil || v.State != "ready" {
			b.Fatalf("create %s: %d %s", image, code, out)
		}
		if code, _, out := cluster.Do(b, "DELETE", base+"/vms/"+v.ID, ""); code >= 300 {
			b.Fatalf("delete: %d %s", code, out)
		}
		return d
	}
	var imports, oci, guest []time.Duration
	var stored int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		_, l := importOCI(b, base, fmt.Sprintf(`{"source":%q,"id":"bench%d"}`, host+"/bench:1", i))
		if l.Result == nil || l.Result.Image == nil {
			b.Fatalf("import: %+v", l)
		}
		imports = append(imports, time.Since(start))
		stored = l.Result.Image.Oci.StoredBytes
		guest = append(guest, ready("test-guest"))
		oci = append(oci, ready(fmt.Sprintf("bench%d", i)))
	}
	b.StopTimer()
	im, o, g := median(imports), median(oci), median(guest)
	b.ReportMetric(im.Seconds(), "import-s")
	b.ReportMetric(float64(layerBytes)/1e6, "layers-MB")
	b.ReportMetric(float64(stored)/1e6, "stored-MB")
	b.ReportMetric(o.Seconds(), "oci-ready-s")
	b.ReportMetric(g.Seconds(), "testguest-ready-s")
	b.ReportMetric(o.Seconds()/g.Seconds(), "oci/testguest")
	fmt.Printf("OCI image of %.1f MB of layers (gzip), median of %d: import %.1fs (root and hash tree stored: %.1f MB); create→ready %.1fs against the test guest's %.1fs: ratio %.2f\n",
		float64(layerBytes)/1e6, b.N, im.Seconds(), float64(stored)/1e6, o.Seconds(), g.Seconds(), o.Seconds()/g.Seconds())
}
