package verify

import (
	"bytes"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/binary"
	"slices"
	"sync"
	"testing"
	"unicode/utf16"

	"github.com/google/go-tpm-tools/client"
	"github.com/google/go-tpm-tools/simulator"
	"github.com/google/go-tpm/legacy/tpm2"
	"github.com/google/go-tpm/tpmutil"
)

// The simulator is one per process, so every test shares this fixture. Its
// PCRs 0–8 hold exactly the extends of bootEvents (so log replays them), PCR
// 11 a UKI boot's (ukiEvents, then the word enter-initrd), PCR 13 a
// Kubernetes sysext's words and PCR 15 an OCI root's verity root word: log
// mentions none of 11, 13 and 15, ukiLog and userLog together replay 11
// and 13, verityLog 15.
type fixture struct {
	sim     *simulator.Simulator
	ecc     *client.Key // ECC P-256 AK, kept loaded
	rsa     *client.Key // RSA-2048 AK, kept loaded
	log     []byte      // bootEvents
	ukiLog  []byte      // bootEvents, then ukiEvents
	userLog []byte      // fixtureWords, as vm-agent logs them
	// verityLog is vm-agent's record of fixtureRoot in PCR 15.
	verityLog []byte
}

var (
	fixOnce sync.Once
	fix     *fixture
	fixErr  error
	// The simulator has three transient object slots: two hold the AKs,
	// tests load one more key at a time under this lock.
	simMu sync.Mutex
)

func getFixture(tb testing.TB) *fixture {
	tb.Helper()
	fixOnce.Do(func() { fix, fixErr = newFixture() })
	if fixErr != nil {
		tb.Fatalf("tpm simulator: %v", fixErr)
	}
	return fix
}

func newFixture() (*fixture, error) {
	// A fixed seed gives the same AKs in every process (fuzz workers too).
	sim, err := simulator.GetWithFixedSeedInsecure(20261129)
	if err != nil {
		return nil, err
	}
	f := &fixture{
		sim:       sim,
		log:       buildLog(bootEvents, sha1Alg, sha256Alg),
		ukiLog:    buildLog(slices.Concat(bootEvents, ukiEvents()), sha1Alg, sha256Alg),
		userLog:   userLog(fixtureWords()...),
		verityLog: userLog(fixtureVerityWord()),
	}
	for _, e := range slices.Concat(bootEvents, ukiEvents()) {
		if err := tpm2.PCREvent(sim, tpmutil.Handle(e.pcr), e.measured()); err != nil {
			return nil, err
		}
	}
	for _, w := range append(fixtureWords(), fixtureVerityWord()) {
		if err := tpm2.PCREvent(sim, tpmutil.Handle(w.pcr), []byte(w.word)); err != nil {
			return nil, err
		}
	}
	if f.ecc, err = client.AttestationKeyECC(sim); err != nil {
		return nil, err
	}
	// RSA keygen is slow; only the tests that need it pay for it.
	return f, nil
}

func (f *fixture) rsaAK(tb testing.TB) *client.Key {
	tb.Helper()
	if f.rsa == nil {
		k, err := client.AttestationKeyRSA(f.sim)
		if err != nil {
			tb.Fatal(err)
		}
		f.rsa = k
	}
	return f.rsa
}

// withKey loads a key from template under the owner hierarchy for fn.
func (f *fixture) withKey(tb testing.TB, template tpm2.Public, fn func(k *client.Key)) {
	tb.Helper()
	simMu.Lock()
	defer simMu.Unlock()
	k, err := client.NewKey(f.sim, tpm2.HandleOwner, template)
	if err != nil {
		tb.Fatal(err)
	}
	defer k.Close()
	fn(k)
}

var (
	initrdPCRs = []int{0, 1, 2, 3, 4, 5, 6, 7, 11}
	readyPCRs  = []int{0, 1, 2, 3, 4, 5, 6, 7, 11, 13}
)

// quote has k quote pcrs of bank hash with nonce, the way the guest agent
// does, and returns what the guest would post (Stage unset).
func (f *fixture) quote(tb testing.TB, k *client.Key, hash tpm2.Algorithm, pcrs []int, nonce []byte) Quote {
	tb.Helper()
	sel := tpm2.PCRSelection{Hash: hash, PCRs: pcrs}
	attest, sig, err := tpm2.QuoteRaw(f.sim, k.Handle(), "", "", nonce, sel, tpm2.AlgNull)
	if err != nil {
		tb.Fatalf("quote: %v", err)
	}
	vals, err := client.ReadPCRs(f.sim, sel)
	if err != nil {
		tb.Fatalf("read pcrs: %v", err)
	}
	pub, err := k.PublicArea().Encode()
	if err != nil {
		tb.Fatal(err)
	}
	return Quote{AKPub: pub, Attest: attest, Signature: sig, PCRs: vals.GetPcrs()}
}

// Crypto-agile TCG log building (TCG PC Client PFP, "Crypto Agile Log
// Entry Format"), independent of the code under test.

type logAlg struct {
	id   uint16
	size int
	sum  func([]byte) []byte
}

var (
	sha1Alg   = logAlg{0x0004, 20, func(b []byte) []byte { s := sha1.Sum(b); return s[:] }}
	sha256Alg = logAlg{0x000b, 32, func(b []byte) []byte { s := sha256.Sum256(b); return s[:] }}
)

type testEvent struct {
	pcr  uint32
	typ  uint32
	data []byte
	// what was hashed into the PCR; data when nil
	meas []byte
}

func (e testEvent) measured() []byte {
	if e.meas != nil {
		return e.meas
	}
	return e.data
}

func le16(v uint16) []byte { return binary.LittleEndian.AppendUint16(nil, v) }
func le32(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }
func le64(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }

func ucs2(s string, nul bool) []byte {
	var b []byte
	for _, c := range utf16.Encode([]rune(s)) {
		b = append(b, le16(c)...)
	}
	if nul {
		b = append(b, 0, 0)
	}
	return b
}

// guidBytes encodes a textual GUID in EFI (mixed-endian) layout.
func guidBytes(d1 uint32, d2, d3 uint16, d4 [8]byte) []byte {
	b := append(le32(d1), le16(d2)...)
	b = append(b, le16(d3)...)
	return append(b, d4[:]...)
}

var (
	globalVar = guidBytes(0x8be4df61, 0x93ca, 0x11d2, [8]byte{0xaa, 0x0d, 0x00, 0xe0, 0x98, 0x03, 0x2b, 0x8c})
	diskGUID  = guidBytes(0x11223344, 0x5566, 0x7788, [8]byte{0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff, 0x00})
)

func variable(vendor []byte, name string, value []byte) []byte {
	n := ucs2(name, false)
	b := append(bytes.Clone(vendor), le64(uint64(len(n)/2))...)
	b = append(b, le64(uint64(len(value)))...)
	b = append(b, n...)
	return append(b, value...)
}

func node(typ, sub byte, data []byte) []byte {
	return append([]byte{typ, sub, byte(len(data) + 4), byte((len(data) + 4) >> 8)}, data...)
}

var endNode = node(0x7f, 0xff, nil)

func bootDiskPath() []byte {
	hd := append(le32(1), le64(2048)...)
	hd = append(hd, le64(204800)...)
	hd = append(hd, diskGUID...)
	hd = append(hd, 2, 2) // GPT partition, GUID signature
	p := node(2, 1, append(le32(0x0a0341d0), le32(0)...))
	p = append(p, node(1, 1, []byte{0, 4})...) // function 0, device 4
	p = append(p, node(4, 1, hd)...)
	p = append(p, node(4, 4, ucs2(`\EFI\BOOT\BOOTX64.EFI`, true))...)
	return append(p, endNode...)
}

func loadOption(desc string, path []byte) []byte {
	b := append(le32(1), le16(uint16(len(path)))...)
	b = append(b, ucs2(desc, true)...)
	return append(b, path...)
}

func imageLoad(path []byte) []byte {
	b := append(le64(0x7e000000), le64(0x20000)...)
	b = append(b, le64(0)...)
	b = append(b, le64(uint64(len(path)))...)
	return append(b, path...)
}

func gptData() []byte {
	h := make([]byte, 92)
	copy(h, "EFI PART")
	copy(h[56:], diskGUID)
	return append(h, le64(0)...)
}

var separator = []byte{0, 0, 0, 0}

const (
	evSeparator      = 0x04
	evAction         = 0x05
	evEventTag       = 0x06
	evSCRTMVersion   = 0x08
	evIPL            = 0x0d
	evNoAction       = 0x03
	evVarDriverCfg   = 0x80000001
	evVarBoot        = 0x80000002
	evBootServApp    = 0x80000003
	evGPT            = 0x80000006
	evEFIAction      = 0x80000007
	evFirmwareBlob   = 0x80000008
	evFirmwareBlob2  = 0x8000000a
	evHandoffTables2 = 0x8000000b
)

// bootEvents is a small OVMF-like boot: firmware in PCR 0, boot variables in
// PCR 1, the boot loader in PCR 4, Secure Boot state in PCR 7, a grub
// command in PCR 8 (never quoted here) and a separator for each of 0–7.
var bootEvents = []testEvent{
	{pcr: 0, typ: evSCRTMVersion, data: ucs2("1.00", true)},
	{pcr: 0, typ: evFirmwareBlob, data: append(le64(0xffc84000), le64(0x348000)...), meas: []byte("DXEFV")},
	{pcr: 0, typ: evFirmwareBlob2, data: append(append([]byte{11}, "Fv(PEIFV) \x00"...), append(le64(0x820000), le64(0xe0000)...)...), meas: []byte("PEIFV")},
	{pcr: 1, typ: evVarBoot, data: variable(globalVar, "BootOrder", append(le16(1), le16(0)...))},
	{pcr: 1, typ: evVarBoot, data: variable(globalVar, "Boot0001", loadOption("UEFI QEMU HARDDISK QM00001", bootDiskPath()))},
	{pcr: 1, typ: evHandoffTables2, data: append(append([]byte{9}, "SMBIOS3\x00\x00"...), le64(0)...), meas: []byte("smbios tables")},
	{pcr: 4, typ: evEFIAction, data: []byte("Calling EFI Application from Boot Option")},
	{pcr: 4, typ: evBootServApp, data: imageLoad(bootDiskPath()), meas: []byte("authenticode hash of BOOTX64.EFI")},
	{pcr: 5, typ: evGPT, data: gptData()},
	{pcr: 6, typ: evEventTag, data: append(append(le32(0x8f3b22ed), le32(13)...), "Linux initrd\x00"...), meas: []byte("initrd")},
	{pcr: 7, typ: evVarDriverCfg, data: variable(globalVar, "SecureBoot", []byte{0})},
	{pcr: 7, typ: evVarDriverCfg, data: variable(globalVar, "PK", nil)},
	{pcr: 8, typ: evIPL, data: []byte("grub_cmd: linux /vmlinuz console=ttyS0\x00")},
	{pcr: 0, typ: evSeparator, data: separator},
	{pcr: 1, typ: evSeparator, data: separator},
	{pcr: 2, typ: evSeparator, data: separator},
	{pcr: 3, typ: evSeparator, data: separator},
	{pcr: 4, typ: evSeparator, data: separator},
	{pcr: 5, typ: evSeparator, data: separator},
	{pcr: 6, typ: evSeparator, data: separator},
	{pcr: 7, typ: evSeparator, data: separator},
}

// buildLog writes a Spec ID event (SHA1 format, as the spec requires) and
// then evs in crypto-agile format with a digest per alg.
func buildLog(evs []testEvent, algs ...logAlg) []byte {
	spec := append([]byte("Spec ID Event03\x00"), le32(0)...) // platform class
	spec = append(spec, 0, 2, 0, 2)                           // minor, major, errata, uintnSize (UINT64)
	spec = append(spec, le32(uint32(len(algs)))...)
	for _, a := range algs {
		spec = append(spec, le16(a.id)...)
		spec = append(spec, le16(uint16(a.size))...)
	}
	spec = append(spec, 0) // vendor info size

	b := append(le32(0), le32(evNoAction)...)
	b = append(b, make([]byte, 20)...)
	b = append(b, le32(uint32(len(spec)))...)
	b = append(b, spec...)
	for _, e := range evs {
		b = append(b, le32(e.pcr)...)
		b = append(b, le32(e.typ)...)
		b = append(b, le32(uint32(len(algs)))...)
		for _, a := range algs {
			b = append(b, le16(a.id)...)
			b = append(b, a.sum(e.measured())...)
		}
		b = append(b, le32(uint32(len(e.data)))...)
		b = append(b, e.data...)
	}
	return b
}
