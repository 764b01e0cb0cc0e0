package policystore

import (
	"sync"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
)

// policyCache keeps decoded policies for verdicts: every quote reads its
// image's policy, and decoding its document (a protobuf Struct) per quote
// cost more than the rest of the read. Entries are only ever the stored
// value: a write through UpdatePolicy drops the image's entry, and a read
// that raced with one does not keep what it read (gen).
type policyCache struct {
	mu       sync.Mutex
	gen      uint64
	policies map[string]*attestationv1.ImagePolicy
}

func (c *policyCache) get(image string) (*attestationv1.ImagePolicy, uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.policies[image], c.gen
}

// put keeps p unless a policy was written since gen was read.
func (c *policyCache) put(image string, p *attestationv1.ImagePolicy, gen uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen != gen {
		return
	}
	if c.policies == nil {
		c.policies = map[string]*attestationv1.ImagePolicy{}
	}
	c.policies[image] = p
}

func (c *policyCache) drop(image string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	delete(c.policies, image)
}

// SharedPolicy is GetPolicy for readers that do not modify what they get:
// the policy may be shared with every other such caller until the image's
// next UpdatePolicy. Its size is the stored policies'.
func (s *Store) SharedPolicy(image string) (*attestationv1.ImagePolicy, error) {
	p, gen := s.policies.get(image)
	if p != nil {
		return p, nil
	}
	p, err := s.GetPolicy(image)
	if err != nil {
		return nil, err
	}
	s.policies.put(image, p, gen)
	return p, nil
}
