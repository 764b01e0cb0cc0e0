package tests

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/sha256"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/google/go-tpm/tpm2"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// BenchmarkVerifyQuote measures verified quotes per second through the
// attestation service (gRPC on its unix socket, the nonce in memory, policy
// lookups and verdict writes in bbolt, each verdict on disk before it is
// answered) next to the bare ECDSA signature check of the same quotes, in the
// same run. The services run with GOMAXPROCS=1: one core. callers=1 is one
// call at a time (every verdict pays its own commit's fdatasyncs);
// callers=16 are concurrent callers, as many booting VMs are (their verdicts
// share commits). Quotes come from the real guest agent and swtpm, made
// before the clock starts.
// Run with a fixed count: go test -bench VerifyQuote -benchtime 1000x.
func BenchmarkVerifyQuote(b *testing.B) {
	cluster.RequireTool(b, "swtpm")
	c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{Quiet: true, Env: []string{"GOMAXPROCS=1"}})
	api := "http://" + c.Addr + "/api/v1"
	if code, _, body := cluster.Do(b, "PUT", api+"/images/att-image_1.0.0/policy", attPolicy(zeros)); code != 200 {
		b.Fatalf("import policy: %d %s", code, body)
	}
	conn, err := grpc.NewClient("unix://"+c.VerifierSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	v := attestationv1.NewVerifierServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	tpm := swtpmServerTB(b)
	ak := guestQuote(b, tpm, attestationv1.Stage_STAGE_INITRD, make([]byte, 32)).GetAkPub()

	vms := 0
	for _, callers := range []int{1, 16} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			// One VM per quote: a VM keeps at most 8 nonces outstanding.
			reqs := make([]*attestationv1.VerifyQuoteRequest, b.N)
			for i := range reqs {
				vms++
				id := fmt.Sprintf("%08x", vms)
				if _, err := v.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: id, Image: "att-image_1.0.0", Required: true, AkPublic: ak}); err != nil {
					b.Fatal(err)
				}
				n, err := v.IssueNonce(ctx, &attestationv1.IssueNonceRequest{VmId: id})
				if err != nil {
					b.Fatal(err)
				}
				reqs[i] = guestQuote(b, tpm, attestationv1.Stage_STAGE_INITRD, n.GetNonce())
				reqs[i].VmId = id
			}

			b.ResetTimer()
			cpu0 := processCPU(b, c.Pid("attestation"))
			start := time.Now()
			next := make(chan *attestationv1.VerifyQuoteRequest, len(reqs))
			for _, r := range reqs {
				next <- r
			}
			close(next)
			var wg sync.WaitGroup
			for range callers {
				wg.Go(func() {
					for r := range next {
						resp, err := v.VerifyQuote(ctx, r)
						if err != nil || !resp.GetVerified() {
							b.Errorf("VerifyQuote: %v %q", err, resp.GetMessage())
							return
						}
					}
				})
			}
			wg.Wait()
			service := time.Since(start)
			cpu := processCPU(b, c.Pid("attestation")) - cpu0
			b.StopTimer()

			start = time.Now()
			for _, r := range reqs {
				if err := bareSignatureCheck(r); err != nil {
					b.Fatal(err)
				}
			}
			bare := time.Since(start)
			sq, bq := float64(b.N)/service.Seconds(), float64(b.N)/bare.Seconds()
			b.ReportMetric(sq, "service-quotes/s")
			b.ReportMetric(bq, "bare-quotes/s")
			b.ReportMetric(sq/bq, "service/bare")
			// The service's own CPU per quote: what one core of it can do
			// when the client and the other processes on the host do not
			// share that core.
			b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "service-cpu-µs/quote")
			fmt.Printf("verified quotes per second, service on one core (GOMAXPROCS=1), %d callers, %d quotes: service %.0f, bare signature check %.0f, service/bare %.2f; service CPU %.0f µs/quote\n",
				callers, b.N, sq, bq, sq/bq, float64(cpu.Microseconds())/float64(b.N))
			if b.N >= 100 { // not the testing package's probe run of one quote
				fmt.Println("  " + quoteTargets(b, callers, sq, bq, float64(cpu.Microseconds())/float64(b.N)))
			}
		})
	}
}

// processCPU is the user and system CPU time a process has used, from
// /proc/<pid>/stat (in clock ticks, 100 per second on Linux).
func processCPU(b *testing.B, pid int) time.Duration {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// The command name may hold spaces: the fields after it start at ')'.
	f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+1:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

// bareSignatureCheck is the irreducible work: the AK's ECDSA signature over
// the attest bytes, nothing else.
func bareSignatureCheck(r *attestationv1.VerifyQuoteRequest) error {
	pub, err := tpm2.Unmarshal[tpm2.TPMTPublic](r.GetAkPub())
	if err != nil {
		return err
	}
	point, err := pub.Unique.ECC()
	if err != nil {
		return err
	}
	sig, err := tpm2.Unmarshal[tpm2.TPMTSignature](r.GetSignature())
	if err != nil {
		return err
	}
	es, err := sig.Signature.ECDSA()
	if err != nil {
		return err
	}
	key := &ecdsa.PublicKey{Curve: elliptic.P256(), X: new(big.Int).SetBytes(point.X.Buffer), Y: new(big.Int).SetBytes(point.Y.Buffer)}
	digest := sha256.Sum256(r.GetQuote())
	if !ecdsa.Verify(key, digest[:], new(big.Int).SetBytes(es.SignatureR.Buffer), new(big.Int).SetBytes(es.SignatureS.Buffer)) {
		return fmt.Errorf("signature does not verify")
	}
	return nil
}

// boltCommitP50 is the median time of n bbolt commits, each one small record
// written and synced, on the filesystem the services' state is on (/tmp):
// the floor under a verdict that is on disk before it is answered.
func boltCommitP50(b *testing.B, n int) time.Duration {
	db, err := bolt.Open(filepath.Join(b.TempDir(), "floor.db"), 0o600, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	lat := make([]time.Duration, n)
	for i := range lat {
		start := time.Now()
		if err := db.Update(func(tx *bolt.Tx) error {
			bk, err := tx.CreateBucketIfNotExists([]byte("v"))
			if err != nil {
				return err
			}
			return bk.Put([]byte(fmt.Sprintf("%08x", i)), make([]byte, 512))
		}); err != nil {
			b.Fatal(err)
		}
		lat[i] = time.Since(start)
	}
	return quantile(lat, 0.5)
}

// quoteTargets judges the issue's targets (≥ 2000 verified quotes/s, ≥ 0.5×
// the bare check) and, where one is missed, prints the floor measured now:
// one caller pays a durable commit per verdict, so the commit's own time
// bounds it; many callers share commits, so the service's CPU per quote
// (one core) against the bare check's is what bounds them.
func quoteTargets(b *testing.B, callers int, service, bare, cpuMicros float64) string {
	rate := "met"
	if service < 2000 {
		rate = "not met"
	}
	out := fmt.Sprintf("targets: ≥ 2000 quotes/s %s (%.0f); ≥ 0.50× the bare check ", rate, service)
	if service/bare >= 0.5 {
		return out + fmt.Sprintf("met (%.2f×)", service/bare)
	}
	budget := 2e6 / bare // µs per quote that 0.5× allows
	if callers == 1 {
		p50 := micros(boltCommitP50(b, 200))
		return out + fmt.Sprintf("not met (%.2f×): 0.5× leaves %.0f µs per quote, and one durable bbolt commit of one small record on this disk takes %.0f µs by itself (p50 of 200, measured now); a sequential caller pays one per verdict", service/bare, budget, p50)
	}
	return out + fmt.Sprintf("not met (%.2f×): 0.5× leaves %.0f µs per quote on the service's one core, and it spends %.0f µs of CPU per quote (commits are shared; the rest is gRPC and the wakeups between processes: docs/performance.md#quote-verification)", service/bare, budget, cpuMicros)
}
