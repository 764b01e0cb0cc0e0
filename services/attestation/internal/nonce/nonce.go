// Package nonce keeps attestation nonces in memory (contract §5.1: 32 bytes,
// 5 minutes, single use, bound to the VM and its boot, at most 8 outstanding
// per VM with the oldest dropped).
//
// Nonces are not written to disk. A guest can ask for one as often as it
// likes, and an fsync per nonce in the database every VM's verdicts go to
// would let one guest slow them all; a nonce is worth minutes and one retry.
// A restart therefore loses the outstanding nonces. So that losing one costs
// the guest a retry and not a final rejection (vm-agent gives up on a 403),
// every nonce carries its issue time and a MAC over the VM, the boot and
// itself, under a key kept in attestation.db: Consume tells a nonce an
// earlier run of the service issued to this VM and boot (Lost) from one that
// was never issued, already used, dropped or expired (Unknown).
package nonce

import (
	"container/list"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"sync"
	"time"
)

// The contract's rules, and the default bound on the host's nonces.
const (
	Size       = 32
	TTL        = 5 * time.Minute
	PerVM      = 8
	DefaultMax = 16384 // 8 for each of 2048 VMs; ~200 bytes each
)

// A nonce is issued (8 bytes, Unix nanoseconds, big endian) | random (16) |
// tag (8). The random part alone keeps it unpredictable; the tag only has to
// keep a guest from passing its own bytes off as a lost nonce.
const (
	issuedLen = 8
	randomLen = 16
	tagLen    = Size - issuedLen - randomLen
)

// Result is what Consume found.
type Result int

const (
	// Unknown: never issued to this VM and boot, used, dropped or expired.
	Unknown Result = iota
	// Valid: outstanding for this VM and boot; now used up.
	Valid
	// Lost: issued to this VM and boot by an earlier run of the service
	// and unexpired, so gone with that run; the guest should get a new one.
	Lost
)

func (r Result) String() string {
	switch r {
	case Valid:
		return "valid"
	case Lost:
		return "lost"
	}
	return "unknown"
}

// Stats are counted since the store was made.
type Stats struct {
	Outstanding int
	Max         int
	Issued      uint64
	// DroppedPerVM counts a VM's oldest nonces dropped at its 9th.
	DroppedPerVM uint64
	// DroppedAtMax counts the host's oldest nonces dropped at Max.
	DroppedAtMax uint64
	Expired      uint64
	// Lost counts submissions of nonces an earlier run issued.
	Lost uint64
}

// Options configure a Store.
type Options struct {
	// Key authenticates nonces across restarts: the same key every run.
	Key []byte
	// Max bounds the outstanding nonces of all VMs together; 0 means
	// DefaultMax.
	Max int
	Now func() time.Time
}

// Store holds the outstanding nonces.
type Store struct {
	key     []byte
	max     int
	now     func() time.Time
	started int64 // Unix nanoseconds: nonces issued before are an earlier run's

	mu    sync.Mutex
	order list.List // *entry, oldest first: issue order is expiry order
	vms   map[string]*vmNonces
	seq   uint64
	stats Stats
}

type vmNonces struct {
	live     map[string]*list.Element
	last     time.Time // the latest nonce issued, for nonceIssuedAt
	lastBoot uint64
}

type entry struct {
	vm, nonce string
	boot      uint64
	seq       uint64
	issued    time.Time
	expires   time.Time
}

// New returns an empty store.
func New(o Options) (*Store, error) {
	if len(o.Key) < 16 {
		return nil, errors.New("nonce: the key must have at least 16 bytes")
	}
	if o.Max <= 0 {
		o.Max = DefaultMax
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	s := &Store{key: append([]byte(nil), o.Key...), max: o.Max, now: o.Now, vms: map[string]*vmNonces{}}
	s.started = s.now().UnixNano()
	return s, nil
}

// Issue makes a nonce for the VM's boot. It drops expired nonces, the VM's
// oldest when it has PerVM outstanding, and the host's oldest at Max.
func (s *Store) Issue(vm string, boot uint64) ([]byte, time.Time, error) {
	now := s.now()
	n := make([]byte, Size)
	binary.BigEndian.PutUint64(n, uint64(now.UnixNano()))
	if _, err := rand.Read(n[issuedLen : issuedLen+randomLen]); err != nil {
		return nil, time.Time{}, err
	}
	copy(n[issuedLen+randomLen:], s.tag(vm, boot, n[:issuedLen+randomLen]))

	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweep(now)
	v := s.vms[vm]
	if v == nil {
		v = &vmNonces{live: map[string]*list.Element{}}
		s.vms[vm] = v
	}
	for len(v.live) >= PerVM {
		var oldest *list.Element
		for _, el := range v.live {
			if oldest == nil || el.Value.(*entry).seq < oldest.Value.(*entry).seq {
				oldest = el
			}
		}
		s.remove(oldest)
		s.stats.DroppedPerVM++
	}
	for s.order.Len() >= s.max {
		s.remove(s.order.Front())
		s.stats.DroppedAtMax++
	}
	s.seq++
	e := &entry{vm: vm, nonce: string(n), boot: boot, seq: s.seq, issued: now, expires: now.Add(TTL)}
	v.live[e.nonce] = s.order.PushBack(e)
	v.last, v.lastBoot = now, boot
	s.stats.Issued++
	return n, e.expires, nil
}

// Consume uses a nonce up, whatever the outcome, and says whether it was
// outstanding for this VM and boot.
func (s *Store) Consume(vm string, boot uint64, nonce []byte) Result {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweep(now)
	if v := s.vms[vm]; v != nil {
		if el, ok := v.live[string(nonce)]; ok {
			e := el.Value.(*entry)
			s.remove(el)
			if e.boot == boot && now.Before(e.expires) {
				return Valid
			}
			return Unknown
		}
	}
	if s.lostInRestart(vm, boot, nonce, now) {
		s.stats.Lost++
		return Lost
	}
	return Unknown
}

// lostInRestart: an authentic nonce of this VM and boot, issued before this
// store was made and not expired.
func (s *Store) lostInRestart(vm string, boot uint64, nonce []byte, now time.Time) bool {
	if len(nonce) != Size {
		return false
	}
	issued := int64(binary.BigEndian.Uint64(nonce))
	if issued >= s.started || now.UnixNano()-issued >= int64(TTL) {
		return false
	}
	return hmac.Equal(nonce[issuedLen+randomLen:], s.tag(vm, boot, nonce[:issuedLen+randomLen]))
}

func (s *Store) tag(vm string, boot uint64, body []byte) []byte {
	m := hmac.New(sha256.New, s.key)
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], boot)
	m.Write([]byte("vm-manager nonce v1\x00"))
	m.Write([]byte(vm))
	m.Write([]byte{0})
	m.Write(b[:])
	m.Write(body)
	return m.Sum(nil)[:tagLen]
}

// Forget drops a VM's nonces (the VM was deleted).
func (s *Store) Forget(vm string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.vms[vm]
	if v == nil {
		return
	}
	for _, el := range v.live {
		s.order.Remove(el)
	}
	delete(s.vms, vm)
}

// LastIssued returns when the VM's latest nonce for boot was issued, if this
// run issued one.
func (s *Store) LastIssued(vm string, boot uint64) (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.vms[vm]
	if v == nil || v.last.IsZero() || v.lastBoot != boot {
		return time.Time{}, false
	}
	return v.last, true
}

// Outstanding counts a VM's nonces, expired ones not yet swept included.
func (s *Store) Outstanding(vm string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v := s.vms[vm]; v != nil {
		return len(v.live)
	}
	return 0
}

// Stats returns the counters.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stats
	st.Outstanding, st.Max = s.order.Len(), s.max
	return st
}

// sweep drops expired nonces from the front of the issue order.
func (s *Store) sweep(now time.Time) {
	for el := s.order.Front(); el != nil && !now.Before(el.Value.(*entry).expires); el = s.order.Front() {
		s.remove(el)
		s.stats.Expired++
	}
}

// remove drops one nonce. The VM's entry stays (it remembers the latest
// issue time) until Forget: one per VM in attestation.db, since only those
// are issued nonces (the apiserver does not issue to a VM being forgotten).
func (s *Store) remove(el *list.Element) {
	e := s.order.Remove(el).(*entry)
	if v := s.vms[e.vm]; v != nil {
		delete(v.live, e.nonce)
	}
}
