package swtpm

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/pem"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// withData runs fn against the state's TPM over a data channel, as a guest
// with root would reach it.
func withData(t *testing.T, state string, fn func(transport.TPM)) {
	t.Helper()
	sock := filepath.Join(state, "guest.sock")
	cmd := exec.Command(DefaultBinary, "socket", "--tpm2", "--tpmstate", "dir="+state,
		"--server", "type=unixio,path="+sock, "--flags", "not-need-init,startup-clear")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	var tpm transport.TPMCloser
	deadline := time.Now().Add(5 * time.Second)
	for {
		var err error
		if tpm, err = vtpm.DialSocket(sock, time.Second); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer tpm.Close()
	fn(tpm)
}

func TestProvision(t *testing.T) {
	needSwtpm(t)
	state := filepath.Join(shortDir(t), "tpm")
	ca, err := LoadCA(filepath.Join(shortDir(t), "ca"), "test host")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	start := time.Now()
	first, err := Provision(ctx, Config{StateDir: state}, ca, "0a0b0c0d")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first provisioning took %s", time.Since(start).Round(time.Millisecond))
	if !slices.Equal(first.Created, []string{"ek", "ak", "ek certificate"}) {
		t.Errorf("created %v", first.Created)
	}
	if !vtpm.MatchesTemplate(first.AK.Parsed, vtpm.AKTemplate()) || !vtpm.MatchesTemplate(first.EK.Parsed, vtpm.EKTemplate()) {
		t.Errorf("keys do not match their templates")
	}
	ekPub, err := tpm2.Pub(first.EK.Parsed)
	if err != nil {
		t.Fatal(err)
	}
	if err := ca.Verify(first.EKCertificate, ekPub); err != nil {
		t.Errorf("EK certificate: %v", err)
	}
	cert, _ := x509.ParseCertificate(first.EKCertificate)
	if cert == nil || len(cert.UnknownExtKeyUsage) != 1 || !cert.UnknownExtKeyUsage[0].Equal(oidEKCertificate) {
		t.Errorf("EK certificate lacks tcg-kp-EKCertificate: %+v", cert)
	}

	// Again: nothing to do, the same keys, in a fraction of the time.
	start = time.Now()
	again, err := Provision(ctx, Config{StateDir: state}, ca, "0a0b0c0d")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("second provisioning took %s", time.Since(start).Round(time.Millisecond))
	if len(again.Created) != 0 || !bytes.Equal(again.AK.Public, first.AK.Public) || !bytes.Equal(again.EK.Public, first.EK.Public) ||
		!bytes.Equal(again.EKCertificate, first.EKCertificate) {
		t.Errorf("second provisioning changed something: %v", again.Created)
	}

	// A guest with root puts an unrestricted signing key at the AK handle
	// (one that could sign a forged quote) and an unreadable index where the
	// EK certificate was: the next provisioning replaces both.
	withData(t, state, func(tpm transport.TPM) {
		if err := vtpm.Evict(tpm, again.AK); err != nil {
			t.Fatal(err)
		}
		forged := vtpm.AKTemplate()
		forged.ObjectAttributes.Restricted = false
		srk, err := tpm2.CreatePrimary{PrimaryHandle: tpm2.TPMRHOwner, InPublic: tpm2.New2B(tpm2.ECCSRKTemplate)}.Execute(tpm)
		if err != nil {
			t.Fatal(err)
		}
		parent := tpm2.AuthHandle{Handle: srk.ObjectHandle, Name: srk.Name, Auth: tpm2.PasswordAuth(nil)}
		created, err := tpm2.Create{ParentHandle: parent, InPublic: tpm2.New2B(forged)}.Execute(tpm)
		if err != nil {
			t.Fatal(err)
		}
		loaded, err := tpm2.Load{ParentHandle: parent, InPrivate: created.OutPrivate, InPublic: created.OutPublic}.Execute(tpm)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := (tpm2.EvictControl{Auth: tpm2.TPMRHOwner, ObjectHandle: tpm2.NamedHandle{Handle: loaded.ObjectHandle, Name: loaded.Name}, PersistentHandle: vtpm.AKHandle}).Execute(tpm); err != nil {
			t.Fatal(err)
		}
		if _, err := (tpm2.NVUndefineSpace{AuthHandle: platformAuth, NVIndex: tpm2.NamedHandle{Handle: vtpm.EKCertIndex}}).Execute(tpm); err != nil {
			t.Fatal(err)
		}
		// An index nobody can read with its own auth, in the certificate's place.
		_, err = tpm2.NVDefineSpace{AuthHandle: platformAuth, PublicInfo: tpm2.New2B(tpm2.TPMSNVPublic{
			NVIndex: vtpm.EKCertIndex, NameAlg: tpm2.TPMAlgSHA256, DataSize: 16,
			Attributes: tpm2.TPMANV{PPWrite: true, PPRead: true, PlatformCreate: true, NT: tpm2.TPMNTOrdinary},
		})}.Execute(tpm)
		if err != nil {
			t.Fatal(err)
		}
	})
	replaced, err := Provision(ctx, Config{StateDir: state}, ca, "0a0b0c0d")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(replaced.Created, []string{"ak", "ek certificate"}) || !replaced.AK.Parsed.ObjectAttributes.Restricted ||
		bytes.Equal(replaced.AK.Public, first.AK.Public) || !bytes.Equal(replaced.EK.Public, first.EK.Public) {
		t.Errorf("after the guest's changes: created %v, restricted %v", replaced.Created, replaced.AK.Parsed.ObjectAttributes.Restricted)
	}

	// Another host's CA does not vouch for this EK.
	other, err := LoadCA(filepath.Join(shortDir(t), "ca"), "other host")
	if err != nil {
		t.Fatal(err)
	}
	if other.Verify(first.EKCertificate, ekPub) == nil {
		t.Error("another CA verified this host's EK certificate")
	}
}

func TestLoadCAKeepsItsKey(t *testing.T) {
	dir := filepath.Join(shortDir(t), "ca")
	a, err := LoadCA(dir, "h")
	if err != nil {
		t.Fatal(err)
	}
	b, err := LoadCA(dir, "h")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.CertificatePEM(), b.CertificatePEM()) || !a.key.Equal(b.key) {
		t.Error("a second load made a new CA")
	}
	if blk, _ := pem.Decode(a.CertificatePEM()); blk == nil || blk.Type != "CERTIFICATE" {
		t.Error("CertificatePEM is not a PEM certificate")
	}
}
