// Package store keeps the hypervisor's records in bbolt.
//
// Bucket layout (schema "hypervisor"):
//
//	meta/                schema name and version (pkg/boltdb)
//	vms/<id>             hypervisorv1.VirtualMachine, protobuf binary
//	networks/<name>      hypervisorv1.Network, protobuf binary
//	policy-sync/<ref>    hex SHA-256 of the policy.json last handed to attestation
//	attestation-forget/<id>
//	                     a deleted VM attestation has not forgotten yet (empty value)
//
// Version history:
//
//	1  vms, networks
//	2  policy-sync
//	3  attestation-forget (before, a VM deleted while attestation was down kept
//	   its AK pin, nonces and verdicts there for good)
package store

import (
	"fmt"
	"sort"
	"time"

	"github.com/giantswarm/vm-manager/gen/apierr"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/boltdb"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"
)

var (
	bucketVMs        = []byte("vms")
	bucketNetworks   = []byte("networks")
	bucketPolicySync = []byte("policy-sync")
	bucketForget     = []byte("attestation-forget")
)

// Schema is the hypervisor database's layout and migrations.
var Schema = boltdb.Schema{
	Name: "hypervisor",
	Migrations: []boltdb.Migration{
		{Version: 1, Description: "vms and networks buckets", Apply: boltdb.CreateBuckets(bucketVMs, bucketNetworks)},
		{Version: 2, Description: "policy-sync bucket", Apply: boltdb.CreateBuckets(bucketPolicySync)},
		{Version: 3, Description: "attestation-forget bucket", Apply: boltdb.CreateBuckets(bucketForget)},
	},
}

// Store is the hypervisor's persistent state.
type Store struct{ db *bolt.DB }

// Open opens (and migrates) the database at path.
func Open(path string) (*Store, error) {
	db, err := boltdb.Open(path, Schema, 2*time.Second)
	if err != nil {
		return nil, err
	}
	return &Store{db: db}, nil
}

// Close closes the database.
func (s *Store) Close() error { return s.db.Close() }

// GetVM returns one VM record.
func (s *Store) GetVM(id string) (*hypervisorv1.VirtualMachine, error) {
	vm := &hypervisorv1.VirtualMachine{}
	err := s.db.View(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bucketVMs).Get([]byte(id))
		if raw == nil {
			return apierr.Errorf(apierr.NotFound, "vm %s not found", id)
		}
		return proto.Unmarshal(raw, vm)
	})
	if err != nil {
		return nil, err
	}
	return vm, nil
}

// PutVM writes a VM record.
func (s *Store) PutVM(vm *hypervisorv1.VirtualMachine) error {
	raw, err := proto.Marshal(vm)
	if err != nil {
		return err
	}
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketVMs).Put([]byte(vm.GetId()), raw) })
}

// DeleteVM removes a VM record and, in the same transaction, queues the VM
// for attestation to forget (PendingForgets), so a crash or an attestation
// outage cannot lose that.
func (s *Store) DeleteVM(id string) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketForget).Put([]byte(id), nil); err != nil {
			return err
		}
		return tx.Bucket(bucketVMs).Delete([]byte(id))
	})
}

// PendingForgets returns the deleted VMs attestation has not forgotten yet.
func (s *Store) PendingForgets() ([]string, error) {
	var ids []string
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketForget).ForEach(func(k, _ []byte) error {
			ids = append(ids, string(k))
			return nil
		})
	})
	return ids, err
}

// Forgotten records that attestation forgot a deleted VM.
func (s *Store) Forgotten(id string) error {
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketForget).Delete([]byte(id)) })
}

// ListVMs returns every VM record, oldest first (createdAt, then id).
func (s *Store) ListVMs() ([]*hypervisorv1.VirtualMachine, error) {
	var out []*hypervisorv1.VirtualMachine
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketVMs).ForEach(func(k, v []byte) error {
			vm := &hypervisorv1.VirtualMachine{}
			if err := proto.Unmarshal(v, vm); err != nil {
				return fmt.Errorf("vm %s: %w", k, err)
			}
			out = append(out, vm)
			return nil
		})
	})
	sort.SliceStable(out, func(i, j int) bool {
		a, b := out[i].GetCreatedAt().AsTime(), out[j].GetCreatedAt().AsTime()
		if !a.Equal(b) {
			return a.Before(b)
		}
		return out[i].GetId() < out[j].GetId()
	})
	return out, err
}

// GetNetwork returns one network.
func (s *Store) GetNetwork(name string) (*hypervisorv1.Network, error) {
	n := &hypervisorv1.Network{}
	err := s.db.View(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bucketNetworks).Get([]byte(name))
		if raw == nil {
			return apierr.Errorf(apierr.NotFound, "network %q not found", name)
		}
		return proto.Unmarshal(raw, n)
	})
	if err != nil {
		return nil, err
	}
	return n, nil
}

// ListNetworks returns every network, sorted by name (bbolt keeps keys sorted).
func (s *Store) ListNetworks() ([]*hypervisorv1.Network, error) {
	var out []*hypervisorv1.Network
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketNetworks).ForEach(func(k, v []byte) error {
			n := &hypervisorv1.Network{}
			if err := proto.Unmarshal(v, n); err != nil {
				return fmt.Errorf("network %s: %w", k, err)
			}
			out = append(out, n)
			return nil
		})
	})
	return out, err
}

// PutNetwork writes a network record (spec, gateway, leases).
func (s *Store) PutNetwork(n *hypervisorv1.Network) error {
	raw, err := proto.Marshal(n)
	if err != nil {
		return err
	}
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketNetworks).Put([]byte(n.GetSpec().GetName()), raw) })
}

// DeleteNetwork removes a network record.
func (s *Store) DeleteNetwork(name string) error {
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketNetworks).Delete([]byte(name)) })
}

// PolicySynced returns the digest of the policy last handed to attestation for ref.
func (s *Store) PolicySynced(ref string) (string, error) {
	var digest string
	err := s.db.View(func(tx *bolt.Tx) error {
		digest = string(tx.Bucket(bucketPolicySync).Get([]byte(ref)))
		return nil
	})
	return digest, err
}

// SetPolicySynced records that attestation holds the policy with this digest.
func (s *Store) SetPolicySynced(ref, digest string) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketPolicySync).Put([]byte(ref), []byte(digest))
	})
}
