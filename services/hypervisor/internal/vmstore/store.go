// Package vmstore keeps the hypervisor's records in bbolt.
//
// Bucket layout (schema "hypervisor"):
//
//	meta/                schema name and version (pkg/boltdb)
//	vms/<id>             storepb.VirtualMachine, protobuf binary (the stored
//	                     record; the API's VirtualMachine is built from it)
//	networks/<name>      hypervisorv1.Network, protobuf binary
//	policy-sync/<ref>    hex SHA-256 of the policy.json last handed to attestation
//	attestation-forget/<id>
//	                     a deleted VM attestation has not forgotten yet (empty value)
//	watch/revision       the watch's revision ceiling, 8 bytes big-endian
//	                     (lifecycle.Broker: none handed out above it)
//	pools/<name>         storepb.Pool, protobuf binary (a warm pool's
//	                     definition; its members are vms/* with pool set)
//
// Version history:
//
//	1  vms, networks
//	2  policy-sync
//	3  attestation-forget (before, a VM deleted while attestation was down kept
//	   its AK pin, nonces and verdicts there for good)
//	4  vms/* are storepb.VirtualMachine, no longer the public
//	   hypervisorv1.VirtualMachine (field numbers are shared, so the records are
//	   decoded and written again as the new message)
//	5  watch (before, revisions started at 1 with every hypervisor)
//	6  pools
package vmstore

import (
	"encoding/binary"
	"fmt"
	"sort"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/boltdb"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"
)

var (
	bucketVMs        = []byte("vms")
	bucketNetworks   = []byte("networks")
	bucketPolicySync = []byte("policy-sync")
	bucketForget     = []byte("attestation-forget")
	bucketWatch      = []byte("watch")
	bucketPools      = []byte("pools")
	keyRevision      = []byte("revision")
)

// Schema is the hypervisor database's layout and migrations. It is declared
// like policystore.Schema (services/attestation): kept apart, as each names
// its own buckets and migrations; what they share is pkg/boltdb.
var Schema = boltdb.Schema{
	Name: "hypervisor",
	Migrations: []boltdb.Migration{
		{Version: 1, Description: "vms and networks buckets", Apply: boltdb.CreateBuckets(bucketVMs, bucketNetworks)},
		{Version: 2, Description: "policy-sync bucket", Apply: boltdb.CreateBuckets(bucketPolicySync)},
		{Version: 3, Description: "attestation-forget bucket", Apply: boltdb.CreateBuckets(bucketForget)},
		{Version: 4, Description: "vm records become storepb.VirtualMachine", Apply: recordsOfTheirOwn},
		{Version: 5, Description: "watch bucket", Apply: boltdb.CreateBuckets(bucketWatch)},
		{Version: 6, Description: "pools bucket", Apply: boltdb.CreateBuckets(bucketPools)},
	},
}

// recordsOfTheirOwn rewrites every VM record as a storepb.VirtualMachine.
// The public message's fields have the same numbers there, process start
// times included; the PEM and hex forms schema 3 kept of the TPM identity are
// dropped (they are derived from the raw keys, which stay).
func recordsOfTheirOwn(tx *bolt.Tx) error {
	return boltdb.RewriteValues(tx.Bucket(bucketVMs), func(k, v []byte) ([]byte, bool, error) {
		vm := &storepb.VirtualMachine{}
		if err := proto.Unmarshal(v, vm); err != nil {
			return nil, false, fmt.Errorf("vm %s: %w", k, err)
		}
		if t := vm.GetTpm(); t != nil {
			t.ProtoReflect().SetUnknown(nil)
		}
		raw, err := proto.Marshal(vm)
		return raw, true, err
	})
}

// Store is the hypervisor's persistent state.
type Store struct{ db *bolt.DB }

// Open opens (and migrates) the database at path.
func Open(path string) (*Store, error) {
	db, err := boltdb.Open(path, Schema, 2*time.Second)
	return &Store{db: db}, err
}

// Close closes the database.
func (s *Store) Close() error { return s.db.Close() }

// GetVM returns one VM record.
func (s *Store) GetVM(id string) (*storepb.VirtualMachine, error) {
	vm := &storepb.VirtualMachine{}
	if err := boltdb.GetProto(s.db, bucketVMs, id, vm, apierr.Errorf(apierr.NotFound, "vm %s not found", id)); err != nil {
		return nil, err
	}
	return vm, nil
}

// PutVM writes a VM record.
func (s *Store) PutVM(vm *storepb.VirtualMachine) error {
	return boltdb.PutProto(s.db, bucketVMs, vm.GetId(), vm)
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
func (s *Store) ListVMs() ([]*storepb.VirtualMachine, error) {
	out, err := boltdb.ListProto(s.db, bucketVMs, func() *storepb.VirtualMachine { return &storepb.VirtualMachine{} })
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
	if err := boltdb.GetProto(s.db, bucketNetworks, name, n, apierr.Errorf(apierr.NotFound, "network %q not found", name)); err != nil {
		return nil, err
	}
	return n, nil
}

// ListNetworks returns every network, sorted by name (bbolt keeps keys sorted).
func (s *Store) ListNetworks() ([]*hypervisorv1.Network, error) {
	return boltdb.ListProto(s.db, bucketNetworks, func() *hypervisorv1.Network { return &hypervisorv1.Network{} })
}

// PutNetwork writes a network record (spec, gateway, leases).
func (s *Store) PutNetwork(n *hypervisorv1.Network) error {
	return boltdb.PutProto(s.db, bucketNetworks, n.GetSpec().GetName(), n)
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

// WatchRevision is the stored revision ceiling of the watch (0 when none).
func (s *Store) WatchRevision() (uint64, error) {
	var r uint64
	err := s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketWatch).Get(keyRevision)
		switch len(v) {
		case 0:
		case 8:
			r = binary.BigEndian.Uint64(v)
		default:
			return fmt.Errorf("watch/revision is %d bytes, want 8", len(v))
		}
		return nil
	})
	return r, err
}

// SetWatchRevision stores the watch's revision ceiling.
func (s *Store) SetWatchRevision(r uint64) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketWatch).Put(keyRevision, binary.BigEndian.AppendUint64(nil, r))
	})
}

// ListPools returns every pool definition, sorted by name.
func (s *Store) ListPools() ([]*storepb.Pool, error) {
	return boltdb.ListProto(s.db, bucketPools, func() *storepb.Pool { return &storepb.Pool{} })
}

// PutPool writes a pool definition.
func (s *Store) PutPool(p *storepb.Pool) error {
	return boltdb.PutProto(s.db, bucketPools, p.GetName(), p)
}

// DeletePool removes a pool definition.
func (s *Store) DeletePool(name string) error {
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketPools).Delete([]byte(name)) })
}
