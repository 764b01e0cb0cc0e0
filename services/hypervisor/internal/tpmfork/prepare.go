package tpmfork

import (
	"context"
	"crypto"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// Extend is one measurement to replay: PCR_Extend of Digest into PCR in
// Bank. The caller takes them, in log order, from the parent's verified
// event logs.
type Extend struct {
	PCR    uint32
	Bank   tpm2.TPMAlgID
	Digest []byte
}

// Platform is what the firmware did to the platform hierarchy before the OS
// ran; the fork's TPM is left the same way.
type Platform int

const (
	// PlatformRandomAuth sets a random platform password nobody keeps: the
	// hierarchy stays enabled but unusable. OVMF does this here (Debian 12's
	// edk2: phEnable set, the empty password refused), so it is the default.
	PlatformRandomAuth Platform = iota
	// PlatformDisabled disables the hierarchy (TPM2_HierarchyControl).
	PlatformDisabled
	// PlatformOpen leaves the empty password: the guest owns the platform
	// hierarchy. Only for firmware that does the same.
	PlatformOpen
)

// Options of Prepare.
type Options struct {
	Platform Platform
}

// Prepared is a fork's TPM state and the identity it holds.
type Prepared struct {
	Blobs
	// Identity is the fork's EK and AK (and EK certificate, with a CA), as
	// read from the TPM that the blobs are the state of.
	Identity *swtpm.Identity
	// PCRs are the sha256 values of the replayed PCRs after the replay.
	PCRs map[uint32][]byte
}

// State files of the host swtpm, in its state directory.
const (
	prepDataSocket = "prep-data.sock"
	prepCtrlSocket = "prep-ctrl.sock"
	prepLog        = "swtpm-prep.log"
	permanentFile  = "tpm2-00.permall"
)

// Prepare makes a fork's TPM state on a host swtpm: a TPM with fresh seeds
// (cfg.StateDir must hold no TPM state; empty: a temporary directory), the
// fork's own EK, AK and EK certificate (swtpm.Provision), TPM2_Startup(CLEAR)
// as the firmware sends it, the replayed measurements, and then its
// PERMANENT, VOLATILE and SAVESTATE blobs as QEMU would have saved them.
func Prepare(ctx context.Context, cfg swtpm.Config, ca *swtpm.CA, vmID string, replay []Extend, opt Options) (*Prepared, error) {
	if err := checkReplay(replay); err != nil {
		return nil, err
	}
	if cfg.StateDir == "" {
		dir, err := os.MkdirTemp("", "tpmfork-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		cfg.StateDir = dir
	}
	cfg = cfg.WithDefaults()
	// Fresh seeds are the point: a directory with a TPM in it would give the
	// fork that TPM's EK.
	if _, err := os.Stat(filepath.Join(cfg.StateDir, permanentFile)); !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("tpmfork: %s already holds a TPM state (or cannot be checked: %v)", cfg.StateDir, err)
	}
	id, err := swtpm.Provision(ctx, cfg, ca, vmID)
	if err != nil {
		return nil, fmt.Errorf("tpmfork: provision the fork's keys: %w", err)
	}

	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	data, ctrl := filepath.Join(cfg.StateDir, prepDataSocket), filepath.Join(cfg.StateDir, prepCtrlSocket)
	p, err := startHostSwtpm(cfg, data, ctrl)
	if err != nil {
		return nil, err
	}
	defer func() {
		// CMD_SHUTDOWN ends swtpm; Terminate covers a hung one.
		_ = ctrlCall(ctx, ctrl, CmdShutdown)
		p.Terminate(swtpm.StopGrace)
		os.Remove(data)
		os.Remove(ctrl)
	}()
	t, err := swtpm.DialData(ctx, data, p)
	if err != nil {
		return nil, fmt.Errorf("tpmfork: host swtpm data channel: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { t.Close() })
	pcrs, err := replayAndRead(t, replay, opt)
	stop()
	// No command may be in flight while the state is read.
	t.Close()
	if err != nil {
		return nil, err
	}
	out := &Prepared{Identity: id, PCRs: pcrs}
	for _, bt := range []BlobType{BlobPermanent, BlobVolatile, BlobSaveState} {
		b, flags, err := GetStateBlob(ctx, ctrl, bt)
		var re *ResultError
		if bt == BlobSaveState && errors.As(err, &re) && re.NonFatal() {
			b, flags, err = nil, 0, nil // as QEMU saves it: empty
		}
		if err != nil {
			return nil, fmt.Errorf("tpmfork: %v blob: %w", bt, err)
		}
		if flags&stateFlagEncrypted != 0 {
			return nil, fmt.Errorf("tpmfork: the host swtpm's %v blob is encrypted", bt)
		}
		switch bt {
		case BlobPermanent:
			out.Permanent = b
		case BlobVolatile:
			out.Volatile = b
		case BlobSaveState:
			out.SaveState = b
		}
	}
	return out, nil
}

// startHostSwtpm runs swtpm with a data and a control socket of its own;
// startup-clear: it sends TPM2_Startup(CLEAR) itself, as the firmware does.
func startHostSwtpm(cfg swtpm.Config, data, ctrl string) (*proc.Process, error) {
	logf, err := os.OpenFile(filepath.Join(cfg.StateDir, prepLog), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(cfg.Binary, "socket", "--tpm2",
		"--tpmstate", "dir="+cfg.StateDir,
		"--server", "type=unixio,path="+data,
		"--ctrl", "type=unixio,path="+ctrl,
		"--log", "file="+filepath.Join(cfg.StateDir, prepLog)+",level=1",
		"--flags", "not-need-init,startup-clear")
	cmd.Stdout, cmd.Stderr = logf, logf
	p, err := proc.Start(cmd)
	if err != nil {
		return nil, fmt.Errorf("tpmfork: start host swtpm: %w", err)
	}
	return p, nil
}

var bankHash = map[tpm2.TPMAlgID]crypto.Hash{
	tpm2.TPMAlgSHA1:   crypto.SHA1,
	tpm2.TPMAlgSHA256: crypto.SHA256,
	tpm2.TPMAlgSHA384: crypto.SHA384,
	tpm2.TPMAlgSHA512: crypto.SHA512,
}

// checkReplay refuses what firmware cannot have measured at locality 0:
// PCRs 17-22 are the dynamic (DRTM) ones, reset only at locality 4.
func checkReplay(replay []Extend) error {
	for i, e := range replay {
		h, ok := bankHash[e.Bank]
		switch {
		case !ok:
			return fmt.Errorf("tpmfork: replay %d: bank %s is not supported", i, vtpm.AlgName(e.Bank))
		case len(e.Digest) != h.Size():
			return fmt.Errorf("tpmfork: replay %d: %d-byte digest for bank %s", i, len(e.Digest), vtpm.AlgName(e.Bank))
		case e.PCR > 23 || (e.PCR >= 17 && e.PCR <= 22):
			return fmt.Errorf("tpmfork: replay %d: pcr %d cannot be extended at locality 0", i, e.PCR)
		}
	}
	return nil
}

func replayAndRead(t transport.TPM, replay []Extend, opt Options) (map[uint32][]byte, error) {
	for i, e := range replay {
		_, err := tpm2.PCRExtend{
			PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(e.PCR), Auth: tpm2.PasswordAuth(nil)},
			Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: e.Bank, Digest: e.Digest}}},
		}.Execute(t)
		if err != nil {
			return nil, fmt.Errorf("tpmfork: replay %d (pcr %d, %s): %w", i, e.PCR, vtpm.AlgName(e.Bank), err)
		}
	}
	switch opt.Platform {
	case PlatformRandomAuth:
		auth := make([]byte, 32)
		if _, err := rand.Read(auth); err != nil {
			return nil, err
		}
		_, err := tpm2.HierarchyChangeAuth{AuthHandle: platformAuth, NewAuth: tpm2.TPM2BAuth{Buffer: auth}}.Execute(t)
		if err != nil {
			return nil, fmt.Errorf("tpmfork: randomize the platform password: %w", err)
		}
	case PlatformDisabled:
		if err := disablePlatform(t); err != nil {
			return nil, err
		}
	case PlatformOpen:
	default:
		return nil, fmt.Errorf("tpmfork: platform option %d", opt.Platform)
	}
	pcrs := map[uint32][]byte{}
	for _, e := range replay {
		if e.Bank != tpm2.TPMAlgSHA256 {
			continue
		}
		if _, ok := pcrs[e.PCR]; ok {
			continue
		}
		sel := tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(uint(e.PCR))}}}
		rsp, err := (tpm2.PCRRead{PCRSelectionIn: sel}).Execute(t)
		if err != nil {
			return nil, fmt.Errorf("tpmfork: TPM2_PCR_Read: %w", err)
		}
		if len(rsp.PCRValues.Digests) != 1 {
			return nil, fmt.Errorf("tpmfork: TPM2_PCR_Read of pcr %d: %d digests", e.PCR, len(rsp.PCRValues.Digests))
		}
		pcrs[e.PCR] = rsp.PCRValues.Digests[0].Buffer
	}
	return pcrs, nil
}

var platformAuth = tpm2.AuthHandle{Handle: tpm2.TPMRHPlatform, Auth: tpm2.PasswordAuth(nil)}

// disablePlatform sends TPM2_HierarchyControl(TPM_RH_PLATFORM, enable
// TPM_RH_PLATFORM, NO) with the empty platform password; go-tpm has no
// binding for it.
func disablePlatform(t transport.TPM) error {
	cmd := binary.BigEndian.AppendUint16(nil, uint16(tpm2.TPMSTSessions))
	cmd = binary.BigEndian.AppendUint32(cmd, 0) // size, below
	cmd = binary.BigEndian.AppendUint32(cmd, uint32(tpm2.TPMCCHierarchyControl))
	cmd = binary.BigEndian.AppendUint32(cmd, uint32(tpm2.TPMRHPlatform))
	cmd = binary.BigEndian.AppendUint32(cmd, 9) // authorization area size
	cmd = binary.BigEndian.AppendUint32(cmd, uint32(tpm2.TPMRSPW))
	cmd = append(cmd, 0, 0, 0, 0, 0) // nonce, attributes, empty password
	cmd = binary.BigEndian.AppendUint32(cmd, uint32(tpm2.TPMRHPlatform))
	cmd = append(cmd, 0) // state: NO
	binary.BigEndian.PutUint32(cmd[2:], uint32(len(cmd)))
	rsp, err := t.Send(cmd)
	if err != nil {
		return fmt.Errorf("tpmfork: TPM2_HierarchyControl: %w", err)
	}
	if len(rsp) < 10 {
		return fmt.Errorf("tpmfork: TPM2_HierarchyControl: %d-byte response", len(rsp))
	}
	if rc := binary.BigEndian.Uint32(rsp[6:10]); rc != 0 {
		return fmt.Errorf("tpmfork: TPM2_HierarchyControl: %w", tpm2.TPMRC(rc))
	}
	return nil
}
