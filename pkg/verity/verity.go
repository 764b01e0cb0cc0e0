// Package verity builds the dm-verity hash device of a read-only root, as
// `veritysetup format` does (format version 1, sha256, 4 KiB data and hash
// blocks, a superblock): its root hash goes on a measured kernel command line
// (roothash=), so a quote names the root's content. Built in Go, the import
// of an OCI image needs no cryptsetup on the host; the tests hold it byte for
// byte against veritysetup's.
package verity

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// BlockSize is the data and hash block size.
const BlockSize = 4096

// Params name one hash device.
type Params struct {
	// Salt is prepended to every hashed block (at most 256 bytes; fixed,
	// for a reproducible root hash).
	Salt []byte
	// UUID is the superblock's (16 bytes).
	UUID [16]byte
}

// superblock is struct verity_sb of cryptsetup (lib/verity/verity.c).
type superblock struct {
	Signature     [8]byte
	Version       uint32
	HashType      uint32
	UUID          [16]byte
	Algorithm     [32]byte
	DataBlockSize uint32
	HashBlockSize uint32
	DataBlocks    uint64
	SaltSize      uint16
	_             [6]byte
	Salt          [256]byte
	_             [168]byte
}

// Format reads size bytes of data (a multiple of BlockSize), writes the hash
// device to hash (the superblock, then the tree's levels from the top) and
// returns the root hash.
func Format(data io.Reader, size int64, hash io.Writer, p Params) ([]byte, error) {
	if size <= 0 || size%BlockSize != 0 {
		return nil, fmt.Errorf("verity: data size %d is not a positive multiple of %d", size, BlockSize)
	}
	if len(p.Salt) > 256 {
		return nil, errors.New("verity: salt longer than 256 bytes")
	}
	blocks := size / BlockSize
	// Level 0: one hash per data block.
	level := make([]byte, 0, blocks*sha256.Size)
	buf := make([]byte, BlockSize)
	for range blocks {
		if _, err := io.ReadFull(data, buf); err != nil {
			return nil, fmt.Errorf("verity: read data: %w", err)
		}
		level = append(level, p.sum(buf)...)
	}
	// Hash blocks of a level, zero-padded, are hashed into the next, until
	// one hash is left: the root hash (the data block's own for one block).
	var levels [][]byte
	for len(level) > sha256.Size {
		padded := pad(level)
		levels = append(levels, padded)
		next := make([]byte, 0, len(padded)/BlockSize*sha256.Size)
		for off := 0; off < len(padded); off += BlockSize {
			next = append(next, p.sum(padded[off:off+BlockSize])...)
		}
		level = next
	}
	sb := superblock{Version: 1, HashType: 1, UUID: p.UUID, DataBlockSize: BlockSize, HashBlockSize: BlockSize,
		DataBlocks: uint64(blocks), SaltSize: uint16(len(p.Salt))}
	copy(sb.Signature[:], "verity")
	copy(sb.Algorithm[:], "sha256")
	copy(sb.Salt[:], p.Salt)
	var head bytes.Buffer
	if err := binary.Write(&head, binary.LittleEndian, sb); err != nil {
		return nil, err
	}
	head.Write(make([]byte, BlockSize-head.Len()))
	if _, err := hash.Write(head.Bytes()); err != nil {
		return nil, err
	}
	for i := len(levels) - 1; i >= 0; i-- {
		if _, err := hash.Write(levels[i]); err != nil {
			return nil, err
		}
	}
	return level, nil
}

// sum is a block's hash: sha256 of the salt, then the block (format 1).
func (p Params) sum(block []byte) []byte {
	h := sha256.New()
	h.Write(p.Salt)
	h.Write(block)
	return h.Sum(nil)
}

// pad zero-fills hashes to whole hash blocks.
func pad(hashes []byte) []byte {
	if r := len(hashes) % BlockSize; r != 0 {
		hashes = append(hashes, make([]byte, BlockSize-r)...)
	}
	return hashes
}
