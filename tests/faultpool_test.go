package tests

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// The fault suite's warm pool (issue 28): one member of the shape that half
// of its creates ask for (require_attestation true), refilled in the
// background while the processes are killed; its claims are recorded in
// the ledger and checked: a member is handed to at most one create, also
// across a kill during the claim.

const faultsPoolShape = `"image":"test-guest","memory_mib":384,"cpus":1,"require_attestation":true`

func (f *faultRun) createPool() {
	r := f.call("POST", "/pools", `{"name":"fp","size":1,`+faultsPoolShape+`}`, 20*time.Second)
	if r.err != nil || r.code != 201 {
		f.t.Fatalf("create the pool: %d %v %s", r.code, r.err, r.body)
	}
}

// poolStatus is the pool's members and filling count (ok false when the
// API does not answer).
func (f *faultRun) poolStatus() (members []string, filling int, ok bool) {
	r := f.call("GET", "/pools/fp", "", 20*time.Second)
	if r.err != nil || r.code != 200 {
		return nil, 0, false
	}
	var p poolJSON
	if json.Unmarshal(r.body, &p) != nil {
		return nil, 0, false
	}
	for _, m := range p.Status.Members {
		members = append(members, m.VMID)
	}
	return members, p.Status.Filling, true
}

// poolSettled: no member is booting toward its park.
func (f *faultRun) poolSettled() bool {
	_, filling, ok := f.poolStatus()
	return ok && filling == 0
}

// poolMembers are the members' records.
func (f *faultRun) poolMembers() []vmJSONF {
	ids, _, ok := f.poolStatus()
	if !ok {
		f.t.Errorf("the pool does not answer after the settle")
		return nil
	}
	var out []vmJSONF
	for _, id := range ids {
		r := f.call("GET", "/vms/"+id, "", 20*time.Second)
		var v vmJSONF
		if r.err != nil || r.code != 200 || json.Unmarshal(r.body, &v) != nil {
			f.t.Errorf("pool member %s: %d %v", id, r.code, r.err)
			continue
		}
		out = append(out, v)
	}
	return out
}

// checkParked: a parked member has its saved state.
func (f *faultRun) checkParked(inv *invariants, v vmJSONF) {
	for _, name := range []string{"state.bin", "manifest.json"} {
		if _, err := os.Stat(filepath.Join(v.Paths.Dir, "suspend", name)); err != nil {
			inv.fail("suspended VMs without their saved state", "pool member %s: %v", v.ID, err)
		}
	}
}

// fork forks e once (wait_for none) and enters the fork in the ledger.
func (f *faultRun) fork(e *vmEntry) {
	began := time.Now()
	r := f.call("POST", "/vms/"+e.id+"/fork", `{"count":1,"wait_for":"none"}`, 90*time.Second)
	ok := r.err == nil && r.code == 200
	f.count("fork", ok, began)
	if !ok {
		f.t.Logf("fork of %s after %s: %d %v %s", e.name, time.Since(began).Round(time.Millisecond), r.code, r.err, firstLineOf(string(r.body)))
		f.classify("fork "+e.name, r)
		return
	}
	var resp struct{ Vms []vmJSONF }
	if json.Unmarshal(r.body, &resp) != nil || len(resp.Vms) != 1 {
		f.mu.Lock()
		f.unexpect = append(f.unexpect, "fork of "+e.name+": "+firstLineOf(string(r.body)))
		f.mu.Unlock()
		return
	}
	v := resp.Vms[0]
	f.mu.Lock()
	f.ledger[v.Name] = &vmEntry{name: v.Name, id: v.ID, created: "acked", forwards: map[string]bool{}}
	f.mu.Unlock()
}

// forkOfLedger says whether name is "<a ledger name>-fork-<n>": a fork a
// fork call cut by a kill made without the test learning its name.
func (f *faultRun) forkOfLedger(name string) bool {
	parent, _, ok := strings.Cut(name, "-fork-")
	return ok && f.ledger[parent] != nil
}

// checkAKs: no two running VMs have the same AK (a fork never holds its
// parent's keys).
func (f *faultRun) checkAKs(final []vmJSONF, inv *invariants) {
	seen := map[string]string{}
	for _, v := range final {
		if v.Processes == nil || v.Identity == nil || v.Identity.AkFingerprint == "" {
			continue
		}
		if other, dup := seen[v.Identity.AkFingerprint]; dup && other != v.ID {
			inv.fail("running VMs sharing an AK", "%s and %s both have AK %s", other, v.ID, v.Identity.AkFingerprint)
		}
		seen[v.Identity.AkFingerprint] = v.ID
	}
}

// checkPool: no member went to two creates, and no VM is both a member and
// a claimed VM. Members are the records named pool.<pool>.<id>.
func (f *faultRun) checkPool(final []vmJSONF, inv *invariants) {
	f.checkAKs(final, inv)
	for id, names := range f.claims {
		if distinct := slices.Compact(slices.Sorted(slices.Values(names))); len(distinct) > 1 {
			inv.fail("pool members handed to more than one claimer", "%s went to %s", id, strings.Join(names, ", "))
		}
	}
	member := map[string]bool{}
	for _, v := range final {
		if strings.HasPrefix(v.Name, "pool.") {
			member[v.ID] = true
		}
	}
	for _, v := range final {
		if member[v.ID] && !strings.HasPrefix(v.Name, "pool.") {
			inv.fail("pool members listed as claimed VMs", "%s is a member and the VM %s", v.ID, v.Name)
		}
	}
}
