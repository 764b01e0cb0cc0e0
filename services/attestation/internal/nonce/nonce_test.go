package nonce

import (
	"bytes"
	"fmt"
	"sync"
	"testing"
	"time"
)

var key = bytes.Repeat([]byte{0x42}, 32)

type clock struct{ t time.Time }

func (c *clock) now() time.Time              { return c.t }
func (c *clock) add(d time.Duration)         { c.t = c.t.Add(d) }
func newStore(t *testing.T, c *clock) *Store { return newStoreMax(t, c, 0) }

func newStoreMax(t *testing.T, c *clock, max int) *Store {
	t.Helper()
	s, err := New(Options{Key: key, Max: max, Now: c.now})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func issue(t *testing.T, s *Store, vm string, boot uint64) []byte {
	t.Helper()
	n, _, err := s.Issue(vm, boot)
	if err != nil || len(n) != Size {
		t.Fatalf("Issue: %x %v", n, err)
	}
	return n
}

func TestSingleUseBoundToVMAndBoot(t *testing.T) {
	c := &clock{time.Unix(1_700_000_000, 0)}
	s := newStore(t, c)
	n := issue(t, s, "vm-a", 3)
	if r := s.Consume("vm-a", 3, n); r != Valid {
		t.Fatalf("first use: %v", r)
	}
	if r := s.Consume("vm-a", 3, n); r != Unknown {
		t.Errorf("second use: %v, want Unknown", r)
	}
	// Another VM's nonce, and the VM's nonce of another boot: refused, and
	// used up all the same.
	n = issue(t, s, "vm-b", 3)
	if r := s.Consume("vm-a", 3, n); r != Unknown {
		t.Errorf("another vm's nonce: %v", r)
	}
	if r := s.Consume("vm-b", 3, n); r != Valid {
		t.Errorf("vm-b's own nonce after vm-a tried it: %v", r)
	}
	n = issue(t, s, "vm-a", 3)
	if r := s.Consume("vm-a", 4, n); r != Unknown {
		t.Errorf("an earlier boot's nonce: %v", r)
	}
	if r := s.Consume("vm-a", 3, n); r != Unknown {
		t.Errorf("a nonce tried in another boot was not used up: %v", r)
	}
	if r := s.Consume("vm-a", 3, nil); r != Unknown {
		t.Errorf("no nonce: %v", r)
	}
	if a, b := issue(t, s, "vm-a", 3), issue(t, s, "vm-a", 3); bytes.Equal(a, b) {
		t.Error("two nonces alike")
	}
}

func TestPerVMLimitTTLAndForget(t *testing.T) {
	c := &clock{time.Unix(1_700_000_000, 0)}
	s := newStore(t, c)
	var ns [][]byte
	for range 10 {
		ns = append(ns, issue(t, s, "vm", 1))
		c.add(time.Second)
	}
	other := issue(t, s, "other", 1)
	if n := s.Outstanding("vm"); n != PerVM {
		t.Fatalf("%d outstanding, want %d", n, PerVM)
	}
	if st := s.Stats(); st.DroppedPerVM != 2 || st.Issued != 11 || st.Outstanding != PerVM+1 {
		t.Errorf("stats %+v", st)
	}
	for i, n := range ns[:2] {
		if r := s.Consume("vm", 1, n); r != Unknown {
			t.Errorf("dropped nonce %d: %v", i, r)
		}
	}
	if r := s.Consume("vm", 1, ns[2]); r != Valid {
		t.Errorf("oldest kept nonce: %v", r)
	}
	// Expired: refused, and swept by the next call.
	c.add(TTL)
	if r := s.Consume("vm", 1, ns[9]); r != Unknown {
		t.Errorf("expired nonce: %v", r)
	}
	if st := s.Stats(); st.Outstanding != 0 || st.Expired != PerVM {
		t.Errorf("after the sweep: %+v", st)
	}
	if r := s.Consume("other", 1, other); r != Unknown {
		t.Errorf("expired nonce of another vm: %v", r)
	}
	n := issue(t, s, "vm", 1)
	if at, ok := s.LastIssued("vm", 1); !ok || !at.Equal(c.t) {
		t.Errorf("LastIssued: %v %v", at, ok)
	}
	if _, ok := s.LastIssued("vm", 2); ok {
		t.Error("LastIssued of another boot")
	}
	s.Forget("vm")
	if r := s.Consume("vm", 1, n); r != Unknown || s.Outstanding("vm") != 0 || s.Stats().Outstanding != 0 {
		t.Errorf("after Forget: %v, %d outstanding", r, s.Outstanding("vm"))
	}
}

// TestHostLimit: many VMs together hold at most Max nonces; at the bound the
// host's oldest goes, counted.
func TestHostLimit(t *testing.T) {
	c := &clock{time.Unix(1_700_000_000, 0)}
	s := newStoreMax(t, c, 5)
	var ns [][]byte
	for i := range 7 {
		ns = append(ns, issue(t, s, string(rune('a'+i)), 1))
		c.add(time.Millisecond)
	}
	if st := s.Stats(); st.Outstanding != 5 || st.Max != 5 || st.DroppedAtMax != 2 {
		t.Fatalf("stats %+v", st)
	}
	for i, n := range ns {
		want := Valid
		if i < 2 {
			want = Unknown
		}
		if r := s.Consume(string(rune('a'+i)), 1, n); r != want {
			t.Errorf("nonce %d: %v, want %v", i, r, want)
		}
	}
}

// TestLostInRestart: a new store with the same key tells an unexpired nonce
// the previous one issued to this VM and boot (Lost: the guest retries) from
// anything else (Unknown: a verdict), however the nonce was changed.
func TestLostInRestart(t *testing.T) {
	c := &clock{time.Unix(1_700_000_000, 0)}
	before := newStore(t, c)
	n := issue(t, before, "vm-a", 3)
	otherVM := issue(t, before, "vm-b", 3)
	used := issue(t, before, "vm-a", 3)
	if r := before.Consume("vm-a", 3, used); r != Valid {
		t.Fatal(r)
	}
	c.add(2 * time.Second) // the restart
	after := newStore(t, c)

	if r := after.Consume("vm-a", 3, n); r != Lost {
		t.Errorf("the lost nonce: %v, want Lost", r)
	}
	if st := after.Stats(); st.Lost != 1 {
		t.Errorf("stats %+v", st)
	}
	for name, tc := range map[string]struct {
		vm    string
		boot  uint64
		nonce []byte
	}{
		"another vm's nonce":      {"vm-a", 3, otherVM},
		"the nonce in another vm": {"vm-b", 3, n},
		"another boot":            {"vm-a", 4, n},
		"a flipped random byte":   {"vm-a", 3, flip(n, issuedLen)},
		"a flipped tag byte":      {"vm-a", 3, flip(n, Size-1)},
		"another issue time":      {"vm-a", 3, flip(n, issuedLen-1)},
		"short":                   {"vm-a", 3, n[:Size-1]},
	} {
		if r := after.Consume(tc.vm, tc.boot, tc.nonce); r != Unknown {
			t.Errorf("%s: %v, want Unknown", name, r)
		}
	}
	// A nonce this run issued and used is not an earlier run's.
	mine := issue(t, after, "vm-a", 3)
	after.Consume("vm-a", 3, mine)
	if r := after.Consume("vm-a", 3, mine); r != Unknown {
		t.Errorf("replay of this run's nonce: %v", r)
	}
	// Another key (another database): not ours.
	other, err := New(Options{Key: bytes.Repeat([]byte{1}, 32), Now: c.now})
	if err != nil {
		t.Fatal(err)
	}
	if r := other.Consume("vm-a", 3, n); r != Unknown {
		t.Errorf("under another key: %v", r)
	}
	// Expired by now.
	c.add(TTL)
	if r := after.Consume("vm-a", 3, n); r != Unknown {
		t.Errorf("expired lost nonce: %v", r)
	}
}

func flip(b []byte, i int) []byte {
	b = append([]byte(nil), b...)
	b[i] ^= 1
	return b
}

func TestKeyRequired(t *testing.T) {
	if _, err := New(Options{Key: []byte("short")}); err == nil {
		t.Error("a 5-byte key was accepted")
	}
}

// TestConcurrentGuests: guests of many VMs issuing and consuming at once
// (run with -race) each get their own nonces accepted once, and the bounds
// hold throughout.
func TestConcurrentGuests(t *testing.T) {
	s, err := New(Options{Key: key, Max: 64})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 16)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			vm := fmt.Sprintf("%08x", g)
			for range 200 {
				n, _, err := s.Issue(vm, 1)
				if err != nil {
					errs <- err.Error()
					return
				}
				if r := s.Consume(vm, 1, n); r != Valid && s.Stats().DroppedAtMax == 0 {
					errs <- fmt.Sprintf("%s: own nonce %v with nothing dropped", vm, r)
					return
				}
				if r := s.Consume(vm, 1, n); r != Unknown {
					errs <- fmt.Sprintf("%s: second use %v", vm, r)
					return
				}
				if o := s.Outstanding(vm); o > PerVM {
					errs <- fmt.Sprintf("%s: %d outstanding", vm, o)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	if st := s.Stats(); st.Issued != 16*200 || st.Outstanding > 64 {
		t.Errorf("stats %+v", st)
	}
}
