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

// checkPool: no member went to two creates, and no VM is both a member and
// a claimed VM. Members are the records named pool.<pool>.<id>.
func (f *faultRun) checkPool(final []vmJSONF, inv *invariants) {
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
