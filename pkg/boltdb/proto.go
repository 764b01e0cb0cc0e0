package boltdb

import (
	"fmt"

	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"
)

// The stores keep protobuf records, one per key of a bucket. These are the
// reads and writes they share.

// GetProto decodes bucket/key into m, or returns missing when there is no
// such key.
func GetProto(db *bolt.DB, bucket []byte, key string, m proto.Message, missing error) error {
	return db.View(func(tx *bolt.Tx) error {
		raw := tx.Bucket(bucket).Get([]byte(key))
		if raw == nil {
			return missing
		}
		return proto.Unmarshal(raw, m)
	})
}

// PutProto writes m at bucket/key.
func PutProto(db *bolt.DB, bucket []byte, key string, m proto.Message) error {
	raw, err := proto.Marshal(m)
	if err != nil {
		return err
	}
	return db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucket).Put([]byte(key), raw) })
}

// ListProto decodes every record of bucket, in key order, with fresh messages
// from newT.
func ListProto[T proto.Message](db *bolt.DB, bucket []byte, newT func() T) ([]T, error) {
	var out []T
	err := db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).ForEach(func(k, v []byte) error {
			m := newT()
			if err := proto.Unmarshal(v, m); err != nil {
				return fmt.Errorf("%s/%s: %w", bucket, k, err)
			}
			out = append(out, m)
			return nil
		})
	})
	return out, err
}
