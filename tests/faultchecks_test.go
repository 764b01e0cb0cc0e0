package tests

import (
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/tests/cluster"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"
)

// The fault suite's invariants must be able to fail: the suite's checks run
// here on a fresh cluster, once clean (every count 0) and once with each
// invariant's violation planted (every count at least 1): records, ledger
// entries, processes, directories, sockets, forwards, policies and database
// entries that a bug would leave. No VM boots; an invariant added to the
// suite without a plant here fails this test.
func TestFaultChecksCatch(t *testing.T) {
	images := faultImages(t, cluster.GuestImages(t, ".."))
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	t.Cleanup(func() { killStateProcesses(c.StateDir) })
	f := newFaultRun(t, c, 1)
	f.execFor = time.Second

	golden := strings.Repeat("ab", 32)
	f.golden = map[string]string{"0": golden}
	policy, _ := json.Marshal(map[string]any{"image_id": "test-guest", "image_version": "0.1.0", "golden": map[string]any{"sha256": f.golden}})
	if code, _, b := cluster.Do(t, "PUT", f.base+"/images/"+faultsImage+"/policy", string(policy)); code != 200 {
		t.Fatalf("policy: %d %s", code, b)
	}

	apiOnly := func(kind string) bool {
		return !slices.Contains([]string{"leases without a VM", "attestation records of deleted VMs", "bbolt check errors", "database records differing from the API"}, kind)
	}
	expect := func(phase string, inv *invariants, planted func(kind string) bool) {
		t.Helper()
		for _, kind := range invariantOrder {
			n := inv.counts[kind]
			switch {
			case planted(kind) && n == 0:
				t.Errorf("%s: invariant %q did not catch its planted violation", phase, kind)
			case !planted(kind) && n > 0:
				t.Errorf("%s: invariant %q counts %d without a violation planted", phase, kind, n)
			}
		}
		if t.Failed() {
			for _, d := range inv.details {
				t.Logf("  %s", d)
			}
		}
	}
	none := func(string) bool { return false }

	// Clean: nothing was created, nothing is amiss.
	expect("clean", f.check(f.list()), none)

	// Planted, through what the API, the host and the ledger show.
	f.ledger["lost"] = &vmEntry{name: "lost", id: "0a0a0a0a", created: "acked", forwards: map[string]bool{}}
	f.ledger["wrong"] = &vmEntry{name: "wrong", id: "0a0a0a0b", created: "acked", deleted: "acked", wrongExecs: 1, forwards: map[string]bool{}}
	still, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer still.Close()
	f.ledger["gone"] = &vmEntry{name: "gone", id: "0a0a0a0c", created: "acked", deleted: "acked", forwards: map[string]bool{still.Addr().String(): true}}
	f.ledger["ghost"] = &vmEntry{name: "ghost", id: "0b0b0b02", created: "acked", attest: true, akPin: "sha256:planted", forwards: map[string]bool{}}
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedAddr := closed.Addr().String()
	closed.Close()
	vmDir := func(id string) string { return filepath.Join(c.StateDir, "vms", id) }
	var final []vmJSONF
	for _, raw := range []string{
		// Created by nobody, caught creating, without its directory or lease.
		`{"id":"0b0b0b01","name":"stuck","state":"creating","network":"default","ip":"192.168.127.250","paths":{"dir":"` + vmDir("0b0b0b01") + `"}}`,
		// Two running VMs with one AK (processes that do not run, counted above too).
		`{"id":"0b0b0b08","name":"twin","state":"ready","processes":{"qemu":{"pid":999999997},"tpm":{"pid":999999996}},"tpm":{"akFingerprint":"feedc0de"},"paths":{"dir":"` + vmDir("0b0b0b08") + `"}}`,
		`{"id":"0b0b0b09","name":"twin2","state":"ready","processes":{"qemu":{"pid":999999995},"tpm":{"pid":999999994}},"tpm":{"akFingerprint":"feedc0de"},"paths":{"dir":"` + vmDir("0b0b0b09") + `"}}`,
		// Ready with processes that do not run, no exec, a dead forward,
		// unknown to attestation and the ledger's AK pin; it requires
		// attestation and its initrd quote was refused (user-data gated).
		`{"id":"0b0b0b02","name":"ghost","state":"ready","network":"default","ip":"192.168.127.251","paths":{"dir":"` + vmDir("0b0b0b02") + `"},
		  "processes":{"qemu":{"pid":999999999},"tpm":{"pid":999999998}},"forwards":[{"port":22,"address":"` + closedAddr + `"}],
		  "attestation":{"boot":"1","userDataReleased":false,"initrd":{"verified":false,"message":"unknown or expired nonce"}}}`,
		// Failed without saying why.
		`{"id":"0b0b0b03","name":"mute","state":"failed","paths":{"dir":"` + vmDir("0b0b0b03") + `"}}`,
		// Suspended without a saved state; suspended with one that does not resume.
		`{"id":"0b0b0b04","name":"sleeper","state":"suspended","network":"default","ip":"192.168.127.249","paths":{"dir":"` + vmDir("0b0b0b04") + `"}}`,
		`{"id":"0b0b0b05","name":"dreamer","state":"suspended","network":"default","ip":"192.168.127.248","paths":{"dir":"` + vmDir("0b0b0b05") + `"}}`,
		// A pool member that is also listed as a claimed VM.
		`{"id":"0b0b0b06","name":"pool.fp.0b0b0b06","state":"suspended","paths":{"dir":"` + vmDir("0b0b0b06") + `"}}`,
		`{"id":"0b0b0b06","name":"claimed","state":"stopped","lastError":"x","paths":{"dir":"` + vmDir("0b0b0b06") + `"}}`,
	} {
		var v vmJSONF
		if err := json.Unmarshal([]byte(raw), &v); err != nil {
			t.Fatal(err)
		}
		final = append(final, v)
	}
	// A saved state left in a VM that is not suspended; dreamer's.
	for _, d := range []string{filepath.Join(vmDir("0b0b0b03"), "suspend"), filepath.Join(vmDir("0b0b0b05"), "suspend")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"state.bin", "manifest.json"} {
		if err := os.WriteFile(filepath.Join(vmDir("0b0b0b05"), "suspend", name), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(vmDir("0c0c0c0c"), 0o700); err != nil {
		t.Fatal(err)
	}
	fakeQEMU := filepath.Join(t.TempDir(), "qemu-system-x86_64")
	if err := os.Symlink("/bin/sh", fakeQEMU); err != nil {
		t.Fatal(err)
	}
	stray := exec.Command(fakeQEMU, "-c", "sleep 60; true", "qmp", vmDir("0c0c0c0c")+"/qmp.sock")
	stray.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := stray.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(-stray.Process.Pid, syscall.SIGKILL); _ = stray.Wait() })
	sock, err := net.Listen("unix", filepath.Join(c.RunDir, "stray.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer sock.Close()
	f.golden = map[string]string{"0": strings.Repeat("cd", 32)}
	f.unexpect = append(f.unexpect, "500 internal_error: planted")
	f.claims["0b0b0b07"] = []string{"first", "second"} // one member, two acknowledged claims
	cluster.Eventually(t, 5*time.Second, "the stray process", func() error {
		if len(stateProcesses(c.StateDir)) == 0 {
			return os.ErrNotExist
		}
		return nil
	})
	expect("planted", f.check(final), apiOnly)

	// The databases: clean once the services stopped, then planted.
	f.stopAll()
	f.ledger = map[string]*vmEntry{}
	f.golden = map[string]string{"0": golden}
	inv := &invariants{counts: map[string]int{}}
	f.checkDatabases(nil, inv)
	expect("clean databases", inv, none)

	update := func(name string, fn func(tx *bolt.Tx) error) {
		t.Helper()
		db, err := bolt.Open(filepath.Join(c.StateDir, name), 0o600, &bolt.Options{Timeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		if err := db.Update(fn); err != nil {
			t.Fatal(err)
		}
	}
	update("hypervisor.db", func(tx *bolt.Tx) error {
		vms := tx.Bucket([]byte("vms"))
		if err := vms.Put([]byte("0d0d0d01"), []byte("\xff\xff not a record")); err != nil {
			return err
		}
		rec, _ := proto.Marshal(&hypervisorv1.VirtualMachine{Id: "0d0d0d02", Name: "unlisted"})
		if err := vms.Put([]byte("0d0d0d02"), rec); err != nil {
			return err
		}
		if err := tx.Bucket([]byte("attestation-forget")).Put([]byte("0d0d0d03"), nil); err != nil {
			return err
		}
		nets := tx.Bucket([]byte("networks"))
		n := &hypervisorv1.Network{}
		if err := proto.Unmarshal(nets.Get([]byte("default")), n); err != nil {
			return err
		}
		n.Leases = append(n.Leases, &hypervisorv1.Lease{VmId: "0d0d0d04", Ip: "192.168.127.252"})
		raw, _ := proto.Marshal(n)
		return nets.Put([]byte("default"), raw)
	})
	update("attestation.db", func(tx *bolt.Tx) error {
		return tx.Bucket([]byte("vms")).Put([]byte("0d0d0d05"), []byte(`{"akFingerprint":"sha256:planted"}`))
	})
	inv = &invariants{counts: map[string]int{}}
	f.checkDatabases(nil, inv)
	expect("planted databases", inv, func(kind string) bool { return !apiOnly(kind) })
}
