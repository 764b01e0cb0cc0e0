package apiserver

import (
	"hash/maphash"
	"sync"

	"github.com/giantswarm/vm-manager/services/attestation/internal/store"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
)

// vmLocks serialize the read-modify-write of one VM's record (a verdict, a
// new boot, forgetting it): with group commit a write waits for the commit
// in progress, and two verdicts of one VM read in that window would each
// drop the other's. Striped, so the set is fixed whatever the VMs.
type vmLocks struct {
	seed  maphash.Seed
	locks [64]sync.Mutex
}

func newVMLocks() *vmLocks { return &vmLocks{seed: maphash.MakeSeed()} }

func (l *vmLocks) lock(id string) func() {
	m := &l.locks[maphash.String(l.seed, id)%uint64(len(l.locks))]
	m.Lock()
	return m.Unlock
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

// key returns the VM's registered key parsed, or nil when it has none or it
// does not parse (Check then parses the quote's key and says why).
func (c *akCache) key(vm *store.VM) *verify.AK {
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
