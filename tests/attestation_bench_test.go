package tests

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/sha256"
	"fmt"
	"math/big"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/google/go-tpm/tpm2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// BenchmarkVerifyQuote measures verified quotes per second through the
// attestation service (gRPC on its unix socket, the nonce in memory, policy
// lookups and verdict writes in bbolt, one call at a time, so one core) next to the bare
// ECDSA signature check of the same quotes. Quotes come from the real guest
// agent and swtpm, made before the clock starts.
// Run with a fixed count: go test -bench VerifyQuote -benchtime 100x.
func BenchmarkVerifyQuote(b *testing.B) {
	cluster.RequireTool(b, "swtpm")
	c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{Quiet: true})
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

	// One VM per quote: a VM keeps at most 8 nonces outstanding.
	reqs := make([]*attestationv1.VerifyQuoteRequest, b.N)
	for i := range reqs {
		id := fmt.Sprintf("%08x", i+1)
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
	start := time.Now()
	for _, r := range reqs {
		resp, err := v.VerifyQuote(ctx, r)
		if err != nil || !resp.GetVerified() {
			b.Fatalf("VerifyQuote: %v %q", err, resp.GetMessage())
		}
	}
	service := time.Since(start)
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
	b.ReportMetric(bq/sq, "ratio")
	fmt.Printf("verified quotes per second on one core, %d quotes: service %.0f, bare signature check %.0f, ratio %.1f\n", b.N, sq, bq, bq/sq)
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
