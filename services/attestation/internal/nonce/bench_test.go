package nonce

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"sort"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// durable is the path nonces took before schema 4, kept here only as the
// benchmarks' baseline: per nonce three fsynced bbolt transactions in the
// database every VM's verdicts go to (store nonce, note nonceIssuedAt on the
// VM record, consume nonce). The code is the old store's AddNonce and
// ConsumeNonce.
type durable struct {
	db *bolt.DB
	vm []byte // the VM record rewritten on each issue, as IssueNonce did
}

type oldNonce struct {
	Boot    uint64    `json:"boot"`
	Issued  time.Time `json:"issued"`
	Expires time.Time `json:"expires"`
}

func openDurable(tb testing.TB, path string) *durable {
	tb.Helper()
	return &durable{db: openDB(tb, path), vm: vmRecord(tb)}
}

// openDB opens a bbolt file with the buckets the old path wrote to, with
// bbolt's defaults, as policystore.Open does (an fsync per committed transaction).
func openDB(tb testing.TB, path string) *bolt.DB {
	tb.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { db.Close() })
	if err := db.Update(func(tx *bolt.Tx) error {
		for _, n := range []string{"nonces", "vms"} {
			if _, err := tx.CreateBucketIfNotExists([]byte(n)); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		tb.Fatal(err)
	}
	return db
}

// vmRecord is a VM record of the size a verified boot leaves.
func vmRecord(tb testing.TB) []byte {
	att := &attestationv1.Attestation{Boot: 1, Required: true, UserDataReleased: true, NonceIssuedAt: timestamppb.Now(),
		Initrd: &attestationv1.Quote{Verified: true, Message: "verified: ak 0123456789abcdef, pcr 11 phase enter-initrd", At: timestamppb.Now(), Pcrs: map[uint32]string{}}}
	for i := range uint32(12) {
		att.Initrd.Pcrs[i] = hex.EncodeToString(bytes.Repeat([]byte{byte(i)}, 32))
	}
	raw, err := json.Marshal(&policystore.VM{ID: "0a0b0c0d", Image: "test-guest_0.1.0", AKPub: make([]byte, 90), AKFingerprint: "sha256:" + hex.EncodeToString(make([]byte, 32)), AKOrigin: policystore.OriginHost, Attestation: mustJSON(tb, att)})
	if err != nil {
		tb.Fatal(err)
	}
	return raw
}

func mustJSON(tb testing.TB, v any) json.RawMessage {
	raw, err := json.Marshal(v)
	if err != nil {
		tb.Fatal(err)
	}
	return raw
}

func (d *durable) issue(vm string, boot uint64) ([]byte, error) {
	nonce := make([]byte, Size)
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	now := time.Now()
	n := oldNonce{Boot: boot, Issued: now, Expires: now.Add(TTL)}
	err := d.db.Update(func(tx *bolt.Tx) error {
		b, err := tx.Bucket([]byte("nonces")).CreateBucketIfNotExists([]byte(vm))
		if err != nil {
			return err
		}
		type entry struct {
			key    []byte
			issued time.Time
		}
		var live []entry
		var dead [][]byte
		if err := b.ForEach(func(k, v []byte) error {
			var old oldNonce
			if json.Unmarshal(v, &old) != nil || !now.Before(old.Expires) {
				dead = append(dead, append([]byte(nil), k...))
				return nil
			}
			live = append(live, entry{append([]byte(nil), k...), old.Issued})
			return nil
		}); err != nil {
			return err
		}
		sort.Slice(live, func(i, j int) bool { return live[i].issued.Before(live[j].issued) })
		for len(live) >= PerVM {
			dead = append(dead, live[0].key)
			live = live[1:]
		}
		for _, k := range dead {
			if err := b.Delete(k); err != nil {
				return err
			}
		}
		raw, err := json.Marshal(n)
		if err != nil {
			return err
		}
		return b.Put([]byte(hex.EncodeToString(nonce)), raw)
	})
	if err != nil {
		return nil, err
	}
	// IssueNonce then wrote nonceIssuedAt on the VM's record.
	return nonce, d.db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("vms")).Put([]byte(vm), d.vm) })
}

func (d *durable) consume(vm string, boot uint64, nonce []byte) (bool, error) {
	ok := false
	err := d.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("nonces")).Bucket([]byte(vm))
		if b == nil {
			return nil
		}
		key := []byte(hex.EncodeToString(nonce))
		raw := b.Get(key)
		if raw == nil {
			return nil
		}
		if err := b.Delete(key); err != nil {
			return err
		}
		var n oldNonce
		ok = json.Unmarshal(raw, &n) == nil && time.Now().Before(n.Expires) && n.Boot == boot
		return nil
	})
	return ok, err
}

// BenchmarkNonceIssueConsume: one nonce issued and consumed, in memory (now)
// and the old durable way, side by side on the same disk (b.TempDir), and
// the ratio. Run: go test -run '^$' -bench NonceIssueConsume ./internal/nonce/
func BenchmarkNonceIssueConsume(b *testing.B) {
	mem, err := New(Options{Key: bytes.Repeat([]byte{1}, 32)})
	if err != nil {
		b.Fatal(err)
	}
	dur := openDurable(b, filepath.Join(b.TempDir(), "attestation.db"))
	var memT, durT time.Duration
	for i := 0; b.Loop(); i++ {
		vm := fmt.Sprintf("%08x", i%64)
		t0 := time.Now()
		n, _, err := mem.Issue(vm, 1)
		if err != nil || mem.Consume(vm, 1, n) != Valid {
			b.Fatalf("memory: %v", err)
		}
		t1 := time.Now()
		n, err = dur.issue(vm, 1)
		if err != nil {
			b.Fatal(err)
		}
		if ok, err := dur.consume(vm, 1, n); !ok || err != nil {
			b.Fatalf("durable: %v %v", ok, err)
		}
		memT += t1.Sub(t0)
		durT += time.Since(t1)
	}
	ops := float64(b.N)
	b.ReportMetric(float64(memT.Nanoseconds())/ops, "memory-ns/nonce")
	b.ReportMetric(float64(durT.Nanoseconds())/ops, "bbolt-ns/nonce")
	b.ReportMetric(float64(durT)/float64(memT), "ratio")
}

// BenchmarkVerdictUnderNonceFlood: what one guest fetching and submitting
// nonces as fast as it can does to another VM's verdict writes (its record
// put in vms/, fsynced, as VerifyQuote's record does), with nonces in memory
// and the old durable way, which wrote them to the same database. Each op is
// one verdict write; p50 and p99 of its latency, and the ratios.
// Run: go test -run '^$' -bench VerdictUnderNonceFlood -benchtime 200x ./internal/nonce/
func BenchmarkVerdictUnderNonceFlood(b *testing.B) {
	// The offered load: 4 guests, each asking for (and submitting) 500
	// nonces a second, the same for both paths; the durable path cannot
	// keep up and runs flat out, as the guests' requests would queue.
	const floodGuests, perGuest = 4, 500
	pace := func() func() {
		next := time.Now()
		return func() {
			next = next.Add(time.Second / perGuest)
			if d := time.Until(next); d > 0 {
				time.Sleep(d)
			}
		}
	}
	record := vmRecord(b)
	run := func(name string, flood func(db *bolt.DB, stop <-chan struct{}) int) []time.Duration {
		db := openDB(b, filepath.Join(b.TempDir(), "attestation.db"))
		stop, done := make(chan struct{}), make(chan int, floodGuests)
		for range floodGuests {
			go func() { done <- flood(db, stop) }()
		}
		time.Sleep(20 * time.Millisecond) // the flood is under way
		var lat []time.Duration
		began := time.Now()
		for range b.N {
			t0 := time.Now()
			if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("vms")).Put([]byte("0e0e0e0e"), record) }); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
		}
		took := time.Since(began)
		close(stop)
		nonces := 0
		for range floodGuests {
			nonces += <-done
		}
		b.Logf("%s: %d verdict writes in %s alongside %d nonces issued and consumed by %d guests", name, b.N, took.Round(time.Millisecond), nonces, floodGuests)
		return lat
	}
	memory := func(_ *bolt.DB, stop <-chan struct{}) int {
		mem, err := New(Options{Key: bytes.Repeat([]byte{1}, 32)})
		if err != nil {
			b.Error(err)
			return 0
		}
		wait := pace()
		for n := 0; ; n++ {
			select {
			case <-stop:
				return n
			default:
			}
			wait()
			nonce, _, _ := mem.Issue("0a0b0c0d", 1)
			mem.Consume("0a0b0c0d", 1, nonce)
		}
	}
	durably := func(db *bolt.DB, stop <-chan struct{}) int {
		d := &durable{db: db, vm: record}
		wait := pace()
		for n := 0; ; n++ {
			select {
			case <-stop:
				return n
			default:
			}
			wait()
			nonce, err := d.issue("0a0b0c0d", 1)
			if err == nil {
				_, err = d.consume("0a0b0c0d", 1, nonce)
			}
			if err != nil {
				b.Error(err)
				return n
			}
		}
	}
	memLat := run("memory", memory)
	durLat := run("bbolt", durably)
	pct := func(l []time.Duration, p float64) float64 {
		l = slices.Clone(l)
		slices.Sort(l)
		return float64(l[min(len(l)-1, int(p*float64(len(l))))].Microseconds())
	}
	m50, m99, d50, d99 := pct(memLat, .5), pct(memLat, .99), pct(durLat, .5), pct(durLat, .99)
	b.ReportMetric(m50, "memory-p50-µs")
	b.ReportMetric(m99, "memory-p99-µs")
	b.ReportMetric(d50, "bbolt-p50-µs")
	b.ReportMetric(d99, "bbolt-p99-µs")
	b.ReportMetric(d50/max(m50, 1), "p50-ratio")
	b.ReportMetric(d99/max(m99, 1), "p99-ratio")
}
