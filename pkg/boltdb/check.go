package boltdb

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"io/fs"
	"os"
)

// ErrCorrupt is returned for a database file that bbolt would open wrongly:
// roll back to an older transaction without a word (one meta page damaged),
// or crash on (a file shorter than its pages). Open refuses it before
// writing a byte, so the file stays as it was for recovery.
var ErrCorrupt = errors.New("database file is damaged")

// The on-disk meta page of bbolt's file format version 2 (go.etcd.io/bbolt
// internal/common): a 16-byte page header, then magic, version, page size,
// flags, root bucket {pgid, sequence}, freelist pgid, high water mark pgid,
// txid, and an FNV-64a checksum of everything before it. Fields are in the
// machine's byte order.
const (
	pageHeaderSize = 16
	metaSize       = 64
	metaSumOffset  = 56
	boltMagic      = 0xED0CDAED
	boltVersion    = 2
)

type meta struct {
	pageSize uint32
	root     uint64
	freelist uint64
	pgid     uint64 // high water mark: pages [0, pgid) are in the file
	txid     uint64
}

const noFreelist = ^uint64(0)

// readMetaPage reads and validates the meta page at off.
func readMetaPage(f *os.File, off int64) (meta, error) {
	var b [pageHeaderSize + metaSize]byte
	if _, err := f.ReadAt(b[:], off); err != nil {
		if errors.Is(err, io.EOF) {
			return meta{}, errors.New("the file ends before it")
		}
		return meta{}, err
	}
	m := b[pageHeaderSize:]
	ne := binary.NativeEndian
	switch {
	case ne.Uint32(m[0:]) != boltMagic:
		return meta{}, errors.New("no bbolt magic number")
	case ne.Uint32(m[4:]) != boltVersion:
		return meta{}, fmt.Errorf("file format version %d, want %d", ne.Uint32(m[4:]), boltVersion)
	}
	h := fnv.New64a()
	h.Write(m[:metaSumOffset])
	if h.Sum64() != ne.Uint64(m[metaSumOffset:]) {
		return meta{}, errors.New("checksum mismatch")
	}
	return meta{
		pageSize: ne.Uint32(m[8:]),
		root:     ne.Uint64(m[16:]),
		freelist: ne.Uint64(m[32:]),
		pgid:     ne.Uint64(m[40:]),
		txid:     ne.Uint64(m[48:]),
	}, nil
}

// checkFile refuses a damaged database file before bbolt opens it for
// writing: both meta pages must be valid (bbolt would silently fall back to
// the other one, losing the last committed transaction, and overwrite the
// evidence with its next commit), and the file must hold every page below
// the high water mark (bbolt panics or faults on a truncated file). A
// missing or empty file is a new database.
func checkFile(path string) error {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() == 0 {
		return nil
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%w: not a regular file", ErrCorrupt)
	}
	m0, err := readMetaPage(f, 0)
	if err != nil {
		return fmt.Errorf("%w: meta page 0 is invalid (%v)", ErrCorrupt, err)
	}
	if m0.pageSize < 512 || m0.pageSize&(m0.pageSize-1) != 0 {
		return fmt.Errorf("%w: meta page 0 has page size %d", ErrCorrupt, m0.pageSize)
	}
	m1, err := readMetaPage(f, int64(m0.pageSize))
	if err != nil {
		return fmt.Errorf("%w: meta page 1 is invalid (%v); bbolt would fall back to meta page 0 (transaction %d)", ErrCorrupt, err, m0.txid)
	}
	if m1.pageSize != m0.pageSize {
		return fmt.Errorf("%w: the meta pages disagree on the page size (%d, %d)", ErrCorrupt, m0.pageSize, m1.pageSize)
	}
	for i, m := range []meta{m0, m1} {
		if m.root >= m.pgid || m.freelist >= m.pgid && m.freelist != noFreelist {
			return fmt.Errorf("%w: meta page %d points beyond its high water mark", ErrCorrupt, i)
		}
	}
	cur := m0
	if m1.txid > m0.txid {
		cur = m1
	}
	if need := int64(cur.pgid) * int64(cur.pageSize); fi.Size() < need {
		return fmt.Errorf("%w: %d bytes, but its pages need %d (truncated?)", ErrCorrupt, fi.Size(), need)
	}
	return nil
}
