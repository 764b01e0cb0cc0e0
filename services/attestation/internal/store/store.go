// Package store keeps the attestation service's state in bbolt, so a restart
// loses no policy, pin or verdict.
//
// Bucket layout (schema "attestation"):
//
//	meta/              schema name and version (pkg/boltdb)
//	policies/<image>   attestationv1.ImagePolicy, protobuf binary
//	vms/<vm id>        VM, JSON: image, Kubernetes version, boot, pinned AK,
//	                   and the current boot's attestationv1.Attestation
//
// Version history:
//
//	1  policies, vms
package store

import (
	"encoding/json"
	"time"

	"github.com/giantswarm/vm-manager/gen/apierr"
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/boltdb"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

var (
	bucketPolicies = []byte("policies")
	bucketVMs      = []byte("vms")
)

// Schema is the attestation database's layout and migrations.
var Schema = boltdb.Schema{
	Name: "attestation",
	Migrations: []boltdb.Migration{
		{Version: 1, Description: "policies and vms buckets", Apply: func(tx *bolt.Tx) error {
			for _, b := range [][]byte{bucketPolicies, bucketVMs} {
				if _, err := tx.CreateBucketIfNotExists(b); err != nil {
					return err
				}
			}
			return nil
		}},
	},
}

// VM is what attestation knows about one VM.
type VM struct {
	ID                string `json:"id"`
	Image             string `json:"image"`
	KubernetesVersion string `json:"kubernetesVersion,omitempty"`
	// AKPub is the TPMT_PUBLIC pinned by the first verified initrd quote.
	AKPub         []byte          `json:"akPub,omitempty"`
	AKFingerprint string          `json:"akFingerprint,omitempty"`
	Attestation   json.RawMessage `json:"attestation"` // attestationv1.Attestation, protojson
}

// Store is the attestation service's persistent state.
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

// GetPolicy returns one image's policy.
func (s *Store) GetPolicy(image string) (*attestationv1.ImagePolicy, error) {
	p := &attestationv1.ImagePolicy{}
	err := s.db.View(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bucketPolicies).Get([]byte(image))
		if raw == nil {
			return apierr.Errorf(apierr.NotFound, "no policy for image %q", image)
		}
		return proto.Unmarshal(raw, p)
	})
	if err != nil {
		return nil, err
	}
	return p, nil
}

// UpdatePolicy reads the current policy (nil when none), lets fn produce the
// new one and writes it, in one transaction.
func (s *Store) UpdatePolicy(image string, fn func(old *attestationv1.ImagePolicy) (*attestationv1.ImagePolicy, error)) (*attestationv1.ImagePolicy, error) {
	var out *attestationv1.ImagePolicy
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
	var out []*attestationv1.ImagePolicy
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketPolicies).ForEach(func(_, v []byte) error {
			p := &attestationv1.ImagePolicy{}
			if err := proto.Unmarshal(v, p); err != nil {
				return err
			}
			out = append(out, p)
			return nil
		})
	})
	return out, err
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
	return &vm, att, nil
}

// PutVM writes a VM and its current boot's attestation.
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
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketVMs).Put([]byte(vm.ID), raw) })
}

// DeleteVM forgets a VM.
func (s *Store) DeleteVM(id string) error {
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketVMs).Delete([]byte(id)) })
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
