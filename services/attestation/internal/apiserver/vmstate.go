package apiserver

import (
	"sync"

	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
)

// vmLocks serialize the read-modify-write of one VM's record (a verdict, a
// new boot, forgetting it): with group commit a write waits for the commit
// in progress, and two verdicts of one VM read in that window would each
// drop the other's. One lock per VM with a caller, not stripes: a stripe
// shared by two VMs would make one wait out the other's commit, and the
// commits would carry fewer verdicts. An entry lives while a caller holds
// or waits for it, so there are at most as many as calls in flight.
type vmLocks struct {
	mu    sync.Mutex
	locks map[string]*vmLock
}

type vmLock struct {
	sync.Mutex
	refs int // callers holding or waiting; guarded by vmLocks.mu
}

func newVMLocks() *vmLocks { return &vmLocks{locks: map[string]*vmLock{}} }

// Lock is lock, as the verifier takes it (verifier.Locks).
func (l *vmLocks) Lock(id string) func() { return l.lock(id) }

// lock locks the VM's record and returns the unlock.
func (l *vmLocks) lock(id string) func() {
	l.mu.Lock()
	m := l.locks[id]
	if m == nil {
		m = &vmLock{}
		l.locks[id] = m
	}
	m.refs++
	l.mu.Unlock()
	m.Lock()
	return func() {
		m.Unlock()
		l.mu.Lock()
		if m.refs--; m.refs == 0 {
			delete(l.locks, id)
		}
		l.mu.Unlock()
	}
}

// maxCachedAKs bounds the parsed keys kept; past it, one is dropped per new
// one (counted), and a dropped VM's next quote parses its key again.
const maxCachedAKs = 4096

// akCache keeps each VM's registered AK parsed, so a quote by it does not
// parse the key again (two reflective TPM decodes and a canonical re-encode
// per quote). An entry counts only while the VM's stored fingerprint is its
// key's; BeginBoot and ForgetVirtualMachine drop it.
type akCache struct {
	mu      sync.Mutex
	keys    map[string]*verify.AK // by VM id
	evicted uint64
}

func newAKCache() *akCache { return &akCache{keys: map[string]*verify.AK{}} }

// Key returns the VM's registered key parsed, or nil when it has none or it
// does not parse (Check then parses the quote's key and says why).
func (c *akCache) Key(vm *policystore.VM) *verify.AK {
	if len(vm.AKPub) == 0 {
		return nil
	}
	c.mu.Lock()
	k := c.keys[vm.ID]
	c.mu.Unlock()
	if k != nil && k.Fingerprint() == vm.AKFingerprint {
		return k
	}
	k, err := verify.ParseAK(vm.AKPub)
	if err != nil || k.Fingerprint() != vm.AKFingerprint {
		return nil
	}
	c.put(vm.ID, k)
	return k
}

func (c *akCache) put(id string, k *verify.AK) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.keys[id]; !ok && len(c.keys) >= maxCachedAKs {
		for id := range c.keys {
			delete(c.keys, id)
			c.evicted++
			break
		}
	}
	c.keys[id] = k
}

func (c *akCache) forget(id string) {
	c.mu.Lock()
	delete(c.keys, id)
	c.mu.Unlock()
}
