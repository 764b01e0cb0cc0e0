package apiserver

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"math/big"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"github.com/google/go-tpm/tpm2"
)

// BenchmarkVerifyQuoteInProcess is VerifyQuote without gRPC: the store a real
// bbolt file in the test's temporary directory (on disk, so every verdict's
// commit pays its fsync), quotes from a software AK made before the clock
// starts, one VM per quote (a VM holds at most 8 nonces). Each sub-benchmark
// prints the service's quotes/s next to the bare ECDSA check of the same
// quotes. For a profile: go test -run XXX -bench VerifyQuoteInProcess
// -benchtime 2000x -cpuprofile cpu.out.
func BenchmarkVerifyQuoteInProcess(b *testing.B) {
	for _, c := range []struct {
		callers int
		grpc    bool
	}{{1, false}, {8, false}, {1, true}, {16, true}} {
		name := fmt.Sprintf("callers=%d", c.callers)
		if c.grpc {
			name = "grpc/" + name
		}
		callers := c.callers
		b.Run(name, func(b *testing.B) {
			s, reqs := benchServer(b, b.N)
			verify := s.VerifyQuote
			if c.grpc {
				verify = grpcVerifier(b, s)
			}
			b.ResetTimer()
			cpu0, cs0 := processCPU(), s.store.CommitStats()
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
						resp, err := verify(ctx, r)
						if err != nil || !resp.GetVerified() {
							b.Errorf("VerifyQuote: %v %q", err, resp.GetMessage())
							return
						}
					}
				})
			}
			wg.Wait()
			service := time.Since(start)
			cpu := processCPU() - cpu0
			cs := s.store.CommitStats()
			b.StopTimer()
			start = time.Now()
			for _, r := range reqs {
				if err := bareCheck(r); err != nil {
					b.Fatal(err)
				}
			}
			bare := time.Since(start)
			sq, bq := float64(len(reqs))/service.Seconds(), float64(len(reqs))/bare.Seconds()
			b.ReportMetric(sq, "service-quotes/s")
			b.ReportMetric(bq, "bare-quotes/s")
			b.ReportMetric(sq/bq, "service/bare")
			// The whole process's: the callers' (and with gRPC the
			// client's) share included.
			b.ReportMetric(float64(cpu.Microseconds())/float64(len(reqs)), "cpu-µs/quote")
			b.ReportMetric(float64(cs.Writes-cs0.Writes)/float64(cs.Commits-cs0.Commits), "writes/commit")
		})
	}
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// grpcVerifier serves s's VerifierService as the service does (pkg/mesh,
// a unix socket) and returns a client's VerifyQuote: the in-process bench
// with gRPC's cost, client and server in one profile.
func grpcVerifier(b *testing.B, s *Server) func(context.Context, *attestationv1.VerifyQuoteRequest) (*attestationv1.VerifyQuoteResponse, error) {
	srv := mesh.NewServer(slog.New(slog.DiscardHandler))
	attestationv1.RegisterVerifierServiceServer(srv, s)
	path := filepath.Join(b.TempDir(), "verifier.sock")
	ln, err := mesh.Listen(path)
	if err != nil {
		b.Fatal(err)
	}
	go srv.Serve(ln)
	b.Cleanup(srv.Stop)
	conn, err := mesh.Dial(path)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	client := attestationv1.NewVerifierServiceClient(conn)
	return func(ctx context.Context, r *attestationv1.VerifyQuoteRequest) (*attestationv1.VerifyQuoteResponse, error) {
		return client.VerifyQuote(ctx, r)
	}
}

// benchServer is a server over a fresh bbolt file with a zero policy and n
// VMs, each with the software AK registered and one quote ready to verify.
func benchServer(b *testing.B, n int) (*Server, []*attestationv1.VerifyQuoteRequest) {
	b.Helper()
	st, err := policystore.Open(tempDB(b))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { st.Close() })
	s, err := New(st, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	if err != nil {
		b.Fatal(err)
	}
	zeroPolicy(b, s, 0, 1, 2, 3, 4, 5, 6, 7)
	k := softAK(b)
	pcrs := zeros(attestationv1.Stage_STAGE_INITRD)
	reqs := make([]*attestationv1.VerifyQuoteRequest, n)
	for i := range reqs {
		id := fmt.Sprintf("%08x", i+1)
		if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: id, Image: img, Required: true, AkPublic: k.Public}); err != nil {
			b.Fatal(err)
		}
		nr, err := s.IssueNonce(ctx, &attestationv1.IssueNonceRequest{VmId: id})
		if err != nil {
			b.Fatal(err)
		}
		att, sig, err := k.Quote(nr.GetNonce(), pcrs)
		if err != nil {
			b.Fatal(err)
		}
		reqs[i] = &attestationv1.VerifyQuoteRequest{VmId: id, Stage: attestationv1.Stage_STAGE_INITRD, Nonce: nr.GetNonce(), AkPub: k.Public, Quote: att, Signature: sig, Pcrs: pcrs}
	}
	return s, reqs
}

// bareCheck is the irreducible work, as tests/attestation_bench_test.go
// measures it: the AK's ECDSA signature over the attest bytes.
func bareCheck(r *attestationv1.VerifyQuoteRequest) error {
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
