// Package policystore keeps the attestation service's state in bbolt, so a restart
// loses no policy, pin or verdict. Nonces are not here: they live in memory
// (internal/nonce), since an fsync per nonce let one guest slow every VM's
// verdict writes.
//
// Bucket layout (schema "attestation"):
//
//	meta/              schema name and version (pkg/boltdb)
//	policies/<image>   attestationv1.ImagePolicy, protobuf binary
//	vms/<vm id>        VM, JSON: image, Kubernetes version, the AK whose
//	                   quotes count and its origin, and the current boot's
//	                   attestationv1.Attestation
//	golden-events/<image>
//	                   the event log of the boot golden values were recorded
//	                   from, JSON, to name the events a mismatch differs in
//	keys/nonce-mac     32 random bytes: the MAC key nonces carry, so a nonce
//	                   an earlier run issued is told from a forged one
//
// Version history:
//
//	1  policies, vms
//	2  nonces (before, nonces lived in memory and a restart stranded a
//	   booting guest), golden-events
//	3  vms/*.akOrigin: keys pinned before host provisioning are marked
//	   "first_use" (the first verified initrd quote pinned them)
//	4  nonces dropped (in memory again, each telling a restart's loss from
//	   a forgery, so the guest retries), keys/nonce-mac
package policystore

import (
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/boltdb"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

var (
	bucketPolicies = []byte("policies")
	bucketVMs      = []byte("vms")
	bucketNonces   = []byte("nonces") // versions 2 and 3
	bucketGoldenEv = []byte("golden-events")
	bucketKeys     = []byte("keys")
	keyNonceMAC    = []byte("nonce-mac")
)

// Schema is the attestation database's layout and migrations.
var Schema = boltdb.Schema{
	Name: "attestation",
	Migrations: []boltdb.Migration{
		{Version: 1, Description: "policies and vms buckets", Apply: boltdb.CreateBuckets(bucketPolicies, bucketVMs)},
		{Version: 2, Description: "nonces and golden-events buckets", Apply: boltdb.CreateBuckets(bucketNonces, bucketGoldenEv)},
		{Version: 3, Description: "mark keys pinned on first use", Apply: markFirstUse},
		{Version: 4, Description: "nonces in memory: drop the nonces bucket, add the nonce MAC key", Apply: ephemeralNonces},
	},
}

// AK origins, as stored.
const (
	OriginHost     = "host"
	OriginFirstUse = "first_use"
)

// markFirstUse labels every pinned key of a version-2 database: all of them
// were pinned by a first verified initrd quote.
func markFirstUse(tx *bolt.Tx) error {
	return boltdb.RewriteValues(tx.Bucket(bucketVMs), func(k, v []byte) ([]byte, bool, error) {
		var vm map[string]json.RawMessage
		if err := json.Unmarshal(v, &vm); err != nil {
			return nil, false, fmt.Errorf("vm %s: %w", k, err)
		}
		if _, pinned := vm["akFingerprint"]; !pinned {
			return nil, false, nil
		}
		if _, has := vm["akOrigin"]; has {
			return nil, false, nil
		}
		vm["akOrigin"], _ = json.Marshal(OriginFirstUse)
		raw, err := json.Marshal(vm)
		return raw, err == nil, err
	})
}

// ephemeralNonces drops the outstanding nonces (a guest holding one retries
// with a new one) and makes the key nonces are authenticated with.
func ephemeralNonces(tx *bolt.Tx) error {
	if err := tx.DeleteBucket(bucketNonces); err != nil && !errors.Is(err, bolt.ErrBucketNotFound) {
		return err
	}
	b, err := tx.CreateBucketIfNotExists(bucketKeys)
	if err != nil {
		return err
	}
	if b.Get(keyNonceMAC) != nil {
		return nil
	}
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return err
	}
	return b.Put(keyNonceMAC, key)
}

// VM is what attestation knows about one VM.
type VM struct {
	ID                string `json:"id"`
	Image             string `json:"image"`
	KubernetesVersion string `json:"kubernetesVersion,omitempty"`
	// AKPub is the TPMT_PUBLIC of the one AK whose quotes count: the one
	// the hypervisor read from the VM's vTPM and registered (AKOrigin
	// "host"), or, in databases from before that, the key of the first
	// verified initrd quote ("first_use").
	AKPub         []byte `json:"akPub,omitempty"`
	AKFingerprint string `json:"akFingerprint,omitempty"`
	AKOrigin      string `json:"akOrigin,omitempty"`
	// EKPub is the TPMT_PUBLIC of the VM's endorsement key, as registered.
	EKPub []byte `json:"ekPub,omitempty"`
	// DirectKernel: PCR 9 (the initrd and command line) is golden.
	DirectKernel bool `json:"directKernel,omitempty"`
	// KernelCmdlineExtra is what systemd-stub appends from the host's SMBIOS
	// on the current boot (ignition.firstboot on a first boot): PCR 12 holds it.
	KernelCmdlineExtra string `json:"kernelCmdlineExtra,omitempty"`
	// Firmware is the OVMF build the VM boots, as the hypervisor reported it.
	Firmware *Firmware `json:"firmware,omitempty"`
	// ReadyEvents is the event log of the last verified ready quote, kept
	// for RecordGolden.
	ReadyEvents []verify.Event  `json:"readyEvents,omitempty"`
	Attestation json.RawMessage `json:"attestation"` // attestationv1.Attestation, protojson
}

// Firmware identifies an OVMF build.
type Firmware struct {
	SHA256  string `json:"sha256"`
	Package string `json:"package,omitempty"`
	Version string `json:"version,omitempty"`
}

// Store is the attestation service's persistent state.
type Store struct {
	db       *bolt.DB
	vmw      *committer // VM records: group commit
	policies policyCache
}

// Open opens (and migrates) the database at path.
func Open(path string) (*Store, error) {
	db, err := boltdb.Open(path, Schema, 2*time.Second)
	if err != nil {
		return nil, err
	}
	return newStore(db), nil
}

func newStore(db *bolt.DB) *Store { return &Store{db: db, vmw: newCommitter(db)} }

// Close closes the database, after the commit in progress.
func (s *Store) Close() error {
	s.vmw.close()
	return s.db.Close()
}

// GetPolicy returns one image's policy.
func (s *Store) GetPolicy(image string) (*attestationv1.ImagePolicy, error) {
	p := &attestationv1.ImagePolicy{}
	if err := boltdb.GetProto(s.db, bucketPolicies, image, p, apierr.Errorf(apierr.NotFound, "no policy for image %q", image)); err != nil {
		return nil, err
	}
	return p, nil
}

// UpdatePolicy reads the current policy (nil when none), lets fn produce the
// new one and writes it, in one transaction.
func (s *Store) UpdatePolicy(image string, fn func(old *attestationv1.ImagePolicy) (*attestationv1.ImagePolicy, error)) (*attestationv1.ImagePolicy, error) {
	var out *attestationv1.ImagePolicy
	// Dropped before and after: no read between the two keeps its result.
	s.policies.drop(image)
	defer s.policies.drop(image)
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketPolicies)
		var old *attestationv1.ImagePolicy
		if raw := b.Get([]byte(image)); raw != nil {
			old = &attestationv1.ImagePolicy{}
			if err := proto.Unmarshal(raw, old); err != nil {
				return err
			}
		}
		p, err := fn(old)
		if err != nil {
			return err
		}
		raw, err := proto.Marshal(p)
		if err != nil {
			return err
		}
		out = p
		return b.Put([]byte(image), raw)
	})
	return out, err
}

// ListPolicies returns every policy, sorted by image.
func (s *Store) ListPolicies() ([]*attestationv1.ImagePolicy, error) {
	return boltdb.ListProto(s.db, bucketPolicies, func() *attestationv1.ImagePolicy { return &attestationv1.ImagePolicy{} })
}

// GetVM returns what is known about a VM.
func (s *Store) GetVM(id string) (*VM, *attestationv1.Attestation, error) {
	var vm VM
	err := s.db.View(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bucketVMs).Get([]byte(id))
		if raw == nil {
			return apierr.Errorf(apierr.NotFound, "vm %q not found", id)
		}
		return json.Unmarshal(raw, &vm)
	})
	if err != nil {
		return nil, nil, err
	}
	att := &attestationv1.Attestation{}
	if len(vm.Attestation) > 0 {
		if err := protojson.Unmarshal(vm.Attestation, att); err != nil {
			return nil, nil, err
		}
	}
	// Every summary names the key whose quotes count.
	att.AkFingerprint = vm.AKFingerprint
	switch vm.AKOrigin {
	case OriginHost:
		att.AkOrigin = attestationv1.AkOrigin_AK_ORIGIN_HOST
	case OriginFirstUse:
		att.AkOrigin = attestationv1.AkOrigin_AK_ORIGIN_FIRST_USE
	default:
		att.AkOrigin = attestationv1.AkOrigin_AK_ORIGIN_UNSPECIFIED
	}
	return &vm, att, nil
}

// PutVM writes a VM and its current boot's attestation. It returns when the
// record is on disk; concurrent calls share a commit (see committer).
func (s *Store) PutVM(vm *VM, att *attestationv1.Attestation) error {
	a, err := protojson.Marshal(att)
	if err != nil {
		return err
	}
	vm.Attestation = a
	raw, err := json.Marshal(vm)
	if err != nil {
		return err
	}
	return s.vmw.update(func(tx *bolt.Tx) error { return tx.Bucket(bucketVMs).Put([]byte(vm.ID), raw) })
}

// DeleteVM forgets a VM: record, pin and verdicts.
func (s *Store) DeleteVM(id string) error {
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketVMs).Delete([]byte(id)) })
}

// NonceKey returns the key nonces are authenticated with.
func (s *Store) NonceKey() ([]byte, error) {
	var key []byte
	err := s.db.View(func(tx *bolt.Tx) error {
		key = append(key, tx.Bucket(bucketKeys).Get(keyNonceMAC)...)
		if len(key) == 0 {
			return errors.New("attestation.db has no nonce key")
		}
		return nil
	})
	return key, err
}

// PutGoldenEvents keeps the event log golden values were recorded from.
func (s *Store) PutGoldenEvents(image string, events []verify.Event) error {
	raw, err := json.Marshal(events)
	if err != nil {
		return err
	}
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketGoldenEv).Put([]byte(image), raw) })
}

// GoldenEvents returns the event log golden values were recorded from, if any.
func (s *Store) GoldenEvents(image string) ([]verify.Event, error) {
	var ev []verify.Event
	err := s.db.View(func(tx *bolt.Tx) error {
		if raw := tx.Bucket(bucketGoldenEv).Get([]byte(image)); raw != nil {
			return json.Unmarshal(raw, &ev)
		}
		return nil
	})
	return ev, err
}

// PolicyCount counts stored policies.
func (s *Store) PolicyCount() (int, error) {
	n := 0
	err := s.db.View(func(tx *bolt.Tx) error {
		n = tx.Bucket(bucketPolicies).Stats().KeyN
		return nil
	})
	return n, err
}
