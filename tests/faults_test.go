package tests

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/tests/cluster"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"
)

// The fault suite (issue 8): a seeded random sequence of VM operations on the
// three real binaries, with SIGKILL and restart of one of them at random
// points (some while a create, stop, start, reboot or delete is in flight),
// then invariants over what survives: the API's records against the test's
// own ledger, the QEMU and swtpm processes on the host, the VM directories,
// leases, forwards, sockets, golden values and AK pins, and both bbolt files.
//
//	make test-faults                       # a seed from the clock
//	FAULTS_SEED=42 FAULTS_EVENTS=45 make test-faults
//
// Plain `go test ./...` skips it: it needs FAULTS=1 (the make target sets
// it) or a -run pattern naming TestFaults.

const (
	faultsImage     = "test-guest_0.1.0"
	faultsMaxVMs    = 4 // records at once, so at most four QEMUs
	faultsLoopLimit = 330 * time.Second
	faultsSettle    = 150 * time.Second
)

// faultsEnabled is FAULTS=1 or a -run pattern that names the test.
func faultsEnabled() (bool, string) {
	if os.Getenv("FAULTS") == "1" {
		return true, ""
	}
	if f := flag.Lookup("test.run"); f != nil && strings.Contains(f.Value.String(), "TestFaults") {
		return true, ""
	}
	return false, "the fault suite runs minutes of SIGKILLs: make test-faults (FAULTS=1) or go test -run '^TestFaults$'"
}

// vmEntry is the ledger's view of one VM, by its unique name.
type vmEntry struct {
	name       string
	id         string
	attest     bool
	created    string // "acked" (201), "maybe" (interrupted or failed), "" (refused before it existed)
	deleted    string // "acked" (204), "maybe", ""
	stopAsked  bool   // a stop (or a reboot's stop half) was asked for, and no start has been answered since
	forwards   map[string]bool
	akPin      string // AK fingerprint of the first verified quote seen
	wrongExecs int
}

type faultRun struct {
	t    *testing.T
	c    *cluster.Cluster
	base string
	rng  *rand.Rand

	mu        sync.Mutex
	ledger    map[string]*vmEntry // by name
	seq       int
	ops       map[string]int // op -> attempts
	opsOK     map[string]int
	opTime    map[string]time.Duration
	downTime  map[string]time.Duration // kill to /readyz, per process
	tolerated map[string]int           // error class -> count
	unexpect  []string
	kills     map[string]int
	inflight  map[string]int // op interrupted by a kill -> count
	cut       map[string]int // suspend/resume calls an outage cut short (transport error or unavailable)
	golden    map[string]string
	execFor   time.Duration       // how long execWorks retries
	claims    map[string][]string // VM id -> the names of the acknowledged creates that claimed it from the pool
}

func newFaultRun(t *testing.T, c *cluster.Cluster, seed int64) *faultRun {
	return &faultRun{t: t, c: c, base: "http://" + c.Addr + "/api/v1", rng: rand.New(rand.NewPCG(uint64(seed), 0x5eed)),
		ledger: map[string]*vmEntry{}, ops: map[string]int{}, opsOK: map[string]int{}, opTime: map[string]time.Duration{}, downTime: map[string]time.Duration{}, tolerated: map[string]int{},
		kills: map[string]int{}, inflight: map[string]int{}, cut: map[string]int{}, execFor: 45 * time.Second, claims: map[string][]string{}}
}

type apiResult struct {
	code int
	body []byte
	err  error
}

// call is one REST call that never fails the test: outages are expected.
func (f *faultRun) call(method, path, body string, timeout time.Duration) apiResult {
	req, err := http.NewRequest(method, f.base+path, strings.NewReader(body))
	if err != nil {
		return apiResult{err: err}
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	hc := &http.Client{Timeout: timeout}
	resp, err := hc.Do(req)
	if err != nil {
		return apiResult{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return apiResult{code: resp.StatusCode, body: b, err: err}
}

// classify counts an unsuccessful call: transport errors, unavailable,
// timeouts and conflicts are what an outage (or a view gone stale through
// one) looks like; anything else is unexpected.
func (f *faultRun) classify(op string, r apiResult) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var class string
	switch {
	case r.err != nil:
		class = "transport"
		var ne net.Error
		switch {
		case errors.As(r.err, &ne) && ne.Timeout():
			class = "client timeout"
		case errors.Is(r.err, syscall.ECONNREFUSED):
			class = "connection refused"
		case errors.Is(r.err, syscall.ECONNRESET), errors.Is(r.err, io.EOF), errors.Is(r.err, io.ErrUnexpectedEOF):
			class = "connection reset"
		}
	case r.code == http.StatusServiceUnavailable:
		class = "unavailable"
	case r.code == http.StatusGatewayTimeout:
		class = "timeout"
	case r.code == http.StatusConflict:
		class = "conflict"
	case r.code == http.StatusNotFound:
		class = "not found"
	case r.code == http.StatusInternalServerError && bytes.Contains(r.body, []byte(`"vm_failed"`)):
		class = "vm_failed"
	default:
		f.unexpect = append(f.unexpect, fmt.Sprintf("%s: %d %s", op, r.code, bytes.TrimSpace(r.body)))
		return
	}
	f.tolerated[class]++
}

// intn is the seeded generator, shared by the loop and an operation in flight.
func (f *faultRun) intn(n int) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.rng.IntN(n)
}

func (f *faultRun) count(op string, ok bool, began time.Time) {
	f.mu.Lock()
	f.opTime[op] += time.Since(began)
	f.ops[op]++
	if ok {
		f.opsOK[op]++
	}
	f.mu.Unlock()
}

// list returns the API's records (nil when the API does not answer).
func (f *faultRun) list() []vmJSONF {
	r := f.call("GET", "/vms", "", 20*time.Second)
	if r.err != nil || r.code != 200 {
		f.classify("list", r)
		return nil
	}
	var out []vmJSONF
	if err := json.Unmarshal(r.body, &out); err != nil {
		f.t.Errorf("list: %v", err)
		return nil
	}
	f.mu.Lock()
	for _, v := range out {
		if e := f.ledger[v.Name]; e != nil && e.id == "" {
			e.id = v.ID
		}
	}
	f.mu.Unlock()
	return out
}

// vmJSONF is the REST record with what the invariants look at.
type vmJSONF struct {
	ID        string `json:"id"`
	Name      string `json:"name"`
	State     string `json:"state"`
	Network   string `json:"network"`
	IP        string `json:"ip"`
	LastError string `json:"lastError"`
	FromPool  string `json:"fromPool"`
	Identity  *struct {
		AkFingerprint string `json:"akFingerprint"`
	} `json:"tpm"`
	Paths struct {
		Dir string `json:"dir"`
	} `json:"paths"`
	Processes *struct {
		Qemu struct {
			Pid int `json:"pid"`
		} `json:"qemu"`
		Tpm struct {
			Pid int `json:"pid"`
		} `json:"tpm"`
	} `json:"processes"`
	Forwards []struct {
		Port    int    `json:"port"`
		Address string `json:"address"`
	} `json:"forwards"`
	Attestation struct {
		Boot             json.Number `json:"boot"`
		UserDataReleased bool        `json:"userDataReleased"`
		Initrd           *struct {
			Verified bool   `json:"verified"`
			Message  string `json:"message"`
		} `json:"initrd"`
	} `json:"attestation"`
}

func (f *faultRun) entry(name string) *vmEntry {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ledger[name]
}

// ---- operations -------------------------------------------------------------

func (f *faultRun) create() {
	f.mu.Lock()
	f.seq++
	name := fmt.Sprintf("f%d", f.seq)
	e := &vmEntry{name: name, attest: f.rng.IntN(2) == 0, created: "maybe", forwards: map[string]bool{}}
	f.ledger[name] = e
	wait := "none"
	if f.rng.IntN(5) < 2 {
		wait = "ready"
	}
	f.mu.Unlock()
	body := fmt.Sprintf(`{"name":%q,"image":"test-guest","memory_mib":384,"cpus":1,"require_attestation":%t,"wait_for":%q`, name, e.attest, wait)
	if e.attest {
		body += `,"user_data":` + ignitionFile("/etc/fault", name)
	}
	body += "}"
	began := time.Now()
	r := f.call("POST", "/vms", body, 90*time.Second)
	ok := r.err == nil && r.code == 201
	f.count("create", ok, began)
	if !ok {
		f.t.Logf("create %s (wait_for %s, require_attestation %t) after %s: %d %v %s", name, wait, e.attest,
			time.Since(began).Round(time.Millisecond), r.code, r.err, firstLineOf(string(bytes.TrimSpace(r.body))))
		f.classify("create "+name, r)
		if r.err == nil && (r.code == 400 || r.code == 409) {
			f.mu.Lock()
			e.created = "" // refused before a record existed
			f.mu.Unlock()
		}
		return
	}
	var v vmJSONF
	_ = json.Unmarshal(r.body, &v)
	f.mu.Lock()
	e.id, e.created = v.ID, "acked"
	if v.FromPool != "" {
		f.claims[v.ID] = append(f.claims[v.ID], name)
	}
	f.mu.Unlock()
	if wait == "ready" && e.attest {
		f.notePin(e)
	}
}

// notePin records the AK fingerprint of a verified quote of e.
func (f *faultRun) notePin(e *vmEntry) {
	if e.id == "" {
		return
	}
	r := f.call("GET", "/vms/"+e.id+"/attestation", "", 10*time.Second)
	if r.err != nil || r.code != 200 {
		return
	}
	type quote struct {
		Verified      bool   `json:"verified"`
		AKFingerprint string `json:"akFingerprint"`
	}
	var att struct{ Initrd, Ready *quote }
	if json.Unmarshal(r.body, &att) != nil {
		return
	}
	for _, q := range []*quote{att.Initrd, att.Ready} {
		if q != nil && q.Verified && q.AKFingerprint != "" {
			f.mu.Lock()
			if e.akPin == "" {
				e.akPin = q.AKFingerprint
			} else if e.akPin != q.AKFingerprint {
				f.unexpect = append(f.unexpect, fmt.Sprintf("vm %s verified with AK %s, pinned %s", e.id, q.AKFingerprint, e.akPin))
			}
			f.mu.Unlock()
		}
	}
}

func (f *faultRun) lifecycle(op string, e *vmEntry) {
	f.mu.Lock()
	id := e.id
	switch op {
	case "stop", "reboot":
		e.stopAsked = true
	case "delete":
		e.deleted = "maybe"
	}
	f.mu.Unlock()
	method, path, want := "POST", "/vms/"+id+"/"+op, 200
	if op == "delete" {
		method, path, want = "DELETE", "/vms/"+id, 204
	}
	began := time.Now()
	r := f.call(method, path, "", 90*time.Second)
	ok := r.err == nil && r.code == want
	f.count(op, ok, began)
	if !ok {
		if (op == "suspend" || op == "resume") && (r.err != nil || r.code == http.StatusServiceUnavailable) {
			f.mu.Lock()
			f.cut[op]++
			f.mu.Unlock()
		}
		f.classify(op+" "+e.name, r)
		if r.err == nil && r.code == 404 && op == "delete" {
			return // gone already (an earlier interrupted delete finished)
		}
		return
	}
	f.mu.Lock()
	switch op {
	case "reboot", "start", "resume":
		// Only an answered start counts: one cut by a kill before the
		// hypervisor recorded it leaves the VM as the last stop left it
		// (stopped, lastError empty), and that is right.
		e.stopAsked = false
	case "delete":
		e.deleted = "acked"
	}
	f.mu.Unlock()
}

func (f *faultRun) forward(e *vmEntry) {
	began := time.Now()
	r := f.call("POST", "/vms/"+e.id+"/forward", `{"port":22}`, 20*time.Second)
	ok := r.err == nil && r.code == 200
	f.count("forward", ok, began)
	if !ok {
		f.classify("forward "+e.name, r)
		return
	}
	var fw struct{ Address string }
	_ = json.Unmarshal(r.body, &fw)
	f.mu.Lock()
	e.forwards[fw.Address] = true
	f.mu.Unlock()
}

func (f *faultRun) exec(e *vmEntry) {
	began := time.Now()
	r := f.call("POST", "/vms/"+e.id+"/exec", `{"command":["hostname"]}`, 30*time.Second)
	ok := r.err == nil && r.code == 200
	f.count("exec", ok, began)
	if !ok {
		f.classify("exec "+e.name, r)
		return
	}
	var res execJSON
	_ = json.Unmarshal(r.body, &res)
	if res.Stdout != e.name+"\n" {
		f.mu.Lock()
		e.wrongExecs++
		f.unexpect = append(f.unexpect, fmt.Sprintf("exec hostname in %s (%s) answered %q", e.name, e.id, res.Stdout))
		f.mu.Unlock()
	}
	if e.attest {
		f.notePin(e)
	}
}

// pickOp chooses an operation from the current records. With a victim it is
// one a kill is fired into (create, stop, start, reboot, delete), and for the
// hypervisor and attestation mostly one that starts a boot.
func (f *faultRun) pickOp(victim string) func() {
	mutating := victim != ""
	launch := 1 // weight of create and start
	if victim == "hypervisor" || victim == "attestation" {
		launch = 3
	}
	vms := f.list()
	if vms == nil {
		return nil
	}
	type choice struct {
		w  int
		fn func()
	}
	var cs []choice
	byState := func(states ...string) []*vmEntry {
		var out []*vmEntry
		for _, v := range vms {
			if slices.Contains(states, v.State) {
				if e := f.entry(v.Name); e != nil && e.id != "" {
					out = append(out, e)
				}
			}
		}
		return out
	}
	pick := func(es []*vmEntry) *vmEntry { return es[f.intn(len(es))] }
	if len(vms) < faultsMaxVMs {
		w := launch
		if len(vms) < 2 {
			w = 4
		}
		cs = append(cs, choice{w, f.create})
	}
	if all := byState("creating", "booting", "attesting", "ready", "running", "stopping", "stopped", "failed", "suspended"); len(all) > 0 {
		w := 1
		if len(vms) >= 3 {
			w = 3
		}
		cs = append(cs, choice{w, func() { f.lifecycle("delete", pick(all)) }})
	}
	if live := byState("booting", "attesting", "ready", "running"); len(live) > 0 {
		cs = append(cs, choice{1, func() { f.lifecycle("stop", pick(live)) }})
	}
	if up := byState("ready", "running"); len(up) > 0 {
		cs = append(cs, choice{1, func() { f.lifecycle("reboot", pick(up)) }})
		if !mutating {
			cs = append(cs, choice{3, func() { f.exec(pick(up)) }})
		}
	}
	if down := byState("stopped", "failed"); len(down) > 0 {
		cs = append(cs, choice{2 * launch, func() { f.lifecycle("start", pick(down)) }})
	}
	// Forks (issue 28): of a ready VM, one at a time.
	if up := byState("ready"); len(up) > 0 && len(vms) < faultsMaxVMs {
		cs = append(cs, choice{2 * launch, func() { f.fork(pick(up)) }})
	}
	// Suspend and resume (issue 19), also as operations a kill is fired into.
	if up := byState("ready", "running"); len(up) > 0 {
		cs = append(cs, choice{2 * launch, func() { f.lifecycle("suspend", pick(up)) }})
	}
	if saved := byState("suspended"); len(saved) > 0 {
		cs = append(cs, choice{3 * launch, func() { f.lifecycle("resume", pick(saved)) }})
		if !mutating {
			cs = append(cs, choice{1, func() { f.lifecycle("stop", pick(saved)) }}) // discards the state
		}
	}
	if any := byState("booting", "attesting", "ready", "running", "stopped", "failed"); len(any) > 0 && !mutating {
		cs = append(cs, choice{1, func() { f.forward(pick(any)) }})
	}
	if victim == "hypervisor" && f.intn(2) == 0 {
		// Half of the hypervisor's kills go into a suspend or resume when
		// one is possible: those are the operations whose halves must not
		// survive a restart (issue 19).
		var sr []choice
		if up := byState("ready", "running"); len(up) > 0 {
			sr = append(sr, choice{1, func() { f.lifecycle("suspend", pick(up)) }})
		}
		if saved := byState("suspended"); len(saved) > 0 {
			sr = append(sr, choice{1, func() { f.lifecycle("resume", pick(saved)) }})
		}
		// And into a fork: a fork whose record, vTPM or message a kill cut.
		if up := byState("ready"); len(up) > 0 && len(vms) < faultsMaxVMs {
			sr = append(sr, choice{1, func() { f.fork(pick(up)) }})
		}
		if len(sr) > 0 {
			return sr[f.intn(len(sr))].fn
		}
	}
	total := 0
	for _, c := range cs {
		total += c.w
	}
	if total == 0 {
		return nil
	}
	n := f.intn(total)
	for _, c := range cs {
		if n < c.w {
			return c.fn
		}
		n -= c.w
	}
	return nil
}

// killSchedule is events victims, each process at least events/3 times (and
// at least 8 when events >= 24), in a random order.
func killSchedule(rng *rand.Rand, events int) []string {
	var out []string
	for _, s := range cluster.Services {
		for range events / 3 {
			out = append(out, s)
		}
	}
	for len(out) < events {
		out = append(out, cluster.Services[rng.IntN(len(cluster.Services))])
	}
	rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// kill SIGKILLs a service, lets the outage last a moment (an API call goes
// into it), restarts it and waits for /readyz.
func (f *faultRun) kill(victim string) {
	began := time.Now()
	defer func() {
		f.mu.Lock()
		f.downTime[victim] += time.Since(began)
		f.mu.Unlock()
	}()
	f.c.StopService(victim)
	f.mu.Lock()
	f.kills[victim]++
	down := time.Duration(100+f.rng.IntN(900)) * time.Millisecond
	f.mu.Unlock()
	r := f.call("GET", "/vms", "", 5*time.Second)
	if r.err != nil || r.code != 200 {
		f.classify("list during outage", r)
	}
	time.Sleep(down)
	f.c.StartService(victim)
	f.c.WaitReady(60 * time.Second)
}

// ---- the test ---------------------------------------------------------------

func TestFaults(t *testing.T) {
	if ok, why := faultsEnabled(); !ok {
		t.Skip(why)
	}
	images := faultImages(t, cluster.GuestImages(t, ".."))
	seed := time.Now().UnixNano() % 1_000_000_000
	if s := os.Getenv("FAULTS_SEED"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("FAULTS_SEED=%q: %v", s, err)
		}
		seed = n
	}
	events := 30
	if s := os.Getenv("FAULTS_EVENTS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 3 {
			t.Fatalf("FAULTS_EVENTS=%q: want a number >= 3", s)
		}
		events = n
	}
	t.Logf("fault suite: seed %d, %d kill/restart events (reproduce: FAULTS_SEED=%d FAULTS_EVENTS=%d make test-faults)", seed, events, seed, events)
	began := time.Now()

	// A guest still in its firmware ignores the ACPI button: 10 s, not 30 s,
	// before a stop escalates to SIGTERM keeps the run within its minutes.
	t.Setenv("VM_MANAGER_STOP_TIMEOUT", "10s")
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("FAULTS_KEEP_LOGS") == "1" {
			keepLogs(t, c, seed)
		}
	})
	t.Cleanup(func() { killStateProcesses(c.StateDir) })
	f := newFaultRun(t, c, seed)

	f.importGolden()
	f.createPool()

	// The loop: a few operations, then a kill (half of the time into an
	// operation in flight), restart, /readyz.
	schedule := killSchedule(f.rng, events)
	loopStart := time.Now()
	for i, victim := range schedule {
		nops := 1 + f.intn(3)
		if left := faultsLoopLimit - time.Since(loopStart); left < time.Duration(len(schedule)-i)*6*time.Second {
			nops = 0 // behind schedule: only the operation a kill is fired into
		}
		for range nops {
			if op := f.pickOp(""); op != nil {
				op()
			}
		}
		if f.intn(2) == 0 {
			if op := f.pickOp(victim); op != nil {
				done := make(chan struct{})
				go func() { defer close(done); op() }()
				// Half of the kills land in the first 150 ms, where a
				// create or start runs swtpm and QEMU and records them.
				delay := f.intn(1200)
				if f.intn(2) == 0 {
					delay = f.intn(150)
				}
				time.Sleep(time.Duration(delay) * time.Millisecond)
				select {
				case <-done:
				default:
					f.mu.Lock()
					f.inflight[victim]++
					f.mu.Unlock()
				}
				f.kill(victim)
				<-done
				continue
			}
		}
		f.kill(victim)
	}
	loopTook := time.Since(loopStart)

	// Settle: everything up, every VM in a stable state.
	c.WaitReady(60 * time.Second)
	stable := []string{"ready", "running", "stopped", "failed", "suspended"}
	var final []vmJSONF
	settleStart := time.Now()
	for {
		final = f.list()
		busy := 0
		for _, v := range final {
			if !slices.Contains(stable, v.State) {
				busy++
			}
		}
		if final != nil && busy == 0 && f.poolSettled() || time.Since(settleStart) > faultsSettle {
			break
		}
		time.Sleep(2 * time.Second)
	}
	settleTook := time.Since(settleStart)
	time.Sleep(2 * time.Second) // let a just-settled record's processes finish exiting
	final = f.list()
	if final == nil {
		t.Fatal("the API does not answer after the settle")
	}
	// The pool's members are VMs too (processes, directories, leases,
	// database records), hidden from the list.
	members := f.poolMembers()
	final = append(final, members...)

	inv := f.check(final)
	t.Logf("warm pool: %d creates claimed a member, %d members at the end", len(f.claims), len(members))
	f.stopAll()
	f.checkDatabases(final, inv)

	// Report.
	t.Logf("fault suite: seed %d, duration %s (loop %s, settle %s)", seed, time.Since(began).Round(time.Second), loopTook.Round(time.Second), settleTook.Round(time.Second))
	t.Logf("kill/restart events: %d (%s); %d of them into an operation in flight (%s)", total(f.kills), fmtCounts(f.kills), total(f.inflight), fmtCounts(f.inflight))
	var opsLine []string
	for _, op := range slices.Sorted(maps.Keys(f.ops)) {
		opsLine = append(opsLine, fmt.Sprintf("%s %d/%d (%s)", op, f.opsOK[op], f.ops[op], f.opTime[op].Round(time.Second)))
	}
	var downLine []string
	for _, s := range cluster.Services {
		downLine = append(downLine, fmt.Sprintf("%s %s", s, (f.downTime[s]/time.Duration(max(f.kills[s], 1))).Round(10*time.Millisecond)))
	}
	t.Logf("mean kill-to-ready time: %s", strings.Join(downLine, ", "))
	t.Logf("operations (succeeded/attempted, time spent): %d/%d: %s", total(f.opsOK), total(f.ops), strings.Join(opsLine, ", "))
	t.Logf("errors tolerated: %d (%s)", total(f.tolerated), fmtCounts(f.tolerated))
	t.Logf("suspends and resumes an outage cut short: %d (%s)", total(f.cut), fmtCounts(f.cut))
	if b, err := os.ReadFile(filepath.Join(c.Dir, "hypervisor.log")); err == nil {
		t.Logf("recovery in the hypervisor's log: %d VMs re-adopted, %d stray QEMU/swtpm processes ended, %d boots begun in attestation at the first nonce, %d forgets retried, %d leases and %d directories of cut-off creates/deletes swept",
			bytes.Count(b, []byte(`msg="vm re-adopted"`)), bytes.Count(b, []byte("ending a vm process no record lists")),
			bytes.Count(b, []byte("recorded the boot at the guest's first nonce")), bytes.Count(b, []byte("attestation forgot a vm deleted earlier")),
			bytes.Count(b, []byte("releasing the lease of a vm without a record")), bytes.Count(b, []byte("removing the files of a deleted vm")))
		t.Logf("suspend recovery in the hypervisor's log: suspends a restart found in flight: %d continued, %d saved, %d stopped; %d stale saved states removed; %d resumes failed",
			bytes.Count(b, []byte(`from=suspending to=ready last_error="vm-manager restarted`))+bytes.Count(b, []byte(`from=suspending to=running last_error="vm-manager restarted`)),
			bytes.Count(b, []byte(`from=suspending to=suspended last_error="vm-manager restarted`)), bytes.Count(b, []byte(`from=suspending to=stopped last_error="vm-manager restarted`)), bytes.Count(b, []byte("removing the saved state of a vm that was resumed")),
			bytes.Count(b, []byte(`msg="request failed" process=hypervisor method=/vmmanager.hypervisor.v1.HypervisorService/ResumeVirtualMachine`)))
	}
	if b, err := os.ReadFile(filepath.Join(c.Dir, "attestation.log")); err == nil {
		t.Logf("in attestation's log: %d quotes on nonces lost in its restarts (answered unavailable: the guest retries with a new nonce)",
			bytes.Count(b, []byte("quote on a nonce lost in a restart")))
	}
	t.Logf("VMs at the end: %d records; created %d VMs in all", len(final), len(f.ledger))
	failed := 0
	for _, k := range invariantOrder {
		v := inv.counts[k]
		t.Logf("invariant %-48s %d", k, v)
		failed += v
	}
	for _, d := range inv.details {
		t.Logf("  %s", d)
	}
	if failed > 0 {
		t.Errorf("%d invariant violations (seed %d)", failed, seed)
	}
}

// faultImages links the test guest into a directory of the test's own, so
// nothing the services write lands next to the shared image.
func faultImages(t *testing.T, src string) string {
	t.Helper()
	dir := t.TempDir()
	for _, ext := range []string{".vmlinuz", ".initrd", ".cmdline"} {
		if err := os.Symlink(filepath.Join(src, faultsImage+ext), filepath.Join(dir, faultsImage+ext)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// importGolden boots a first VM against the image without a policy (its
// initrd quote is rejected), imports that boot's PCRs as golden values and
// reboots it, so its quote verifies and pins its AK: the state whose
// survival the suite checks at the end.
func (f *faultRun) importGolden() {
	t := f.t
	a := api{t: t, base: f.base}
	v := a.vm("POST", "/vms", `{"name":"f0","image":"test-guest","memory_mib":384,"cpus":1,"require_attestation":true}`, 201)
	var att struct {
		Initrd struct{ Pcrs map[string]string }
	}
	getJSON(t, f.base+"/vms/"+v.ID+"/attestation", &att)
	f.golden = map[string]string{}
	for _, i := range []string{"0", "2", "3", "4", "6", "7", "9"} {
		if att.Initrd.Pcrs[i] == "" {
			t.Fatalf("first boot has no PCR %s: %+v", i, att)
		}
		f.golden[i] = att.Initrd.Pcrs[i]
	}
	policy, _ := json.Marshal(map[string]any{"image_id": "test-guest", "image_version": "0.1.0", "golden": map[string]any{"sha256": f.golden}})
	if code, _, b := cluster.Do(t, "PUT", f.base+"/images/"+faultsImage+"/policy", string(policy)); code != 200 {
		t.Fatalf("import policy: %d %s", code, b)
	}
	a.vm("POST", "/vms/"+v.ID+"/reboot", "", 200)
	a.waitState(v.ID, "ready", bootTimeout)
	e := &vmEntry{name: "f0", id: v.ID, attest: true, created: "acked", forwards: map[string]bool{}}
	f.ledger["f0"] = e
	f.notePin(e)
	if e.akPin == "" {
		t.Fatalf("f0 did not verify after the golden values were imported")
	}
}

// ---- invariants -------------------------------------------------------------

var invariantOrder = []string{
	"vm records lost",
	"vm records resurrected or duplicated",
	"qemu/swtpm processes without a record",
	"records claiming processes that do not run",
	"records without their directory",
	"vm directories without a record",
	"ready/running VMs that do not answer exec",
	"VMs stuck in a transition",
	"suspended VMs without their saved state",
	"suspended VMs that do not resume",
	"saved states of VMs not suspended",
	"stopped/failed VMs without a reason",
	"wrong exec answers during the run",
	"leases without a VM",
	"VMs without their lease",
	"forwards of deleted VMs still accepting",
	"forwards of ready VMs not answering",
	"sockets in the run dir besides the services'",
	"golden values changed",
	"AK pins lost or changed",
	"running VMs sharing an AK",
	"pool members handed to more than one claimer",
	"pool members listed as claimed VMs",
	"VMs whose boot attestation does not know",
	"attested VMs whose user-data stayed gated",
	"attestation records of deleted VMs",
	"unexpected API errors",
	"bbolt check errors",
	"database records differing from the API",
}

type invariants struct {
	counts  map[string]int
	details []string
}

func (inv *invariants) fail(kind, format string, args ...any) {
	if !slices.Contains(invariantOrder, kind) {
		panic("unknown invariant " + kind)
	}
	inv.counts[kind]++
	inv.details = append(inv.details, kind+": "+fmt.Sprintf(format, args...))
}

func (f *faultRun) check(final []vmJSONF) *invariants {
	inv := &invariants{counts: map[string]int{}}
	f.checkPool(final, inv)
	byID := map[string]vmJSONF{}
	byName := map[string]int{}
	for _, v := range final {
		if _, dup := byID[v.ID]; dup {
			inv.fail("vm records resurrected or duplicated", "id %s listed twice", v.ID)
		}
		byID[v.ID] = v
		byName[v.Name]++
	}
	// The ledger against the records.
	for _, name := range slices.Sorted(maps.Keys(f.ledger)) {
		e := f.ledger[name]
		n := byName[name]
		switch {
		case n > 1:
			inv.fail("vm records resurrected or duplicated", "%s has %d records", name, n)
		case e.deleted == "acked" && n > 0:
			inv.fail("vm records resurrected or duplicated", "%s (%s) was deleted (204) and is back", name, e.id)
		case e.created == "acked" && e.deleted == "" && n == 0:
			inv.fail("vm records lost", "%s (%s) was created (201), never deleted, and is gone", name, e.id)
		case e.created == "" && n > 0:
			inv.fail("vm records resurrected or duplicated", "%s was refused at create and exists", name)
		}
		if e.id != "" && n == 1 {
			if v := byID[e.id]; v.Name != name {
				inv.fail("vm records resurrected or duplicated", "%s was created as %s, the record of that name is %s", name, e.id, v.ID)
			}
		}
		if e.wrongExecs > 0 {
			inv.fail("wrong exec answers during the run", "%s answered another hostname %d times", name, e.wrongExecs)
		}
	}
	for _, v := range final {
		if f.ledger[v.Name] == nil && !strings.HasPrefix(v.Name, "pool.fp.") && !f.forkOfLedger(v.Name) { // the pool makes its members; a cut fork call its forks
			inv.fail("vm records resurrected or duplicated", "record %s (%s) was never created by the test", v.ID, v.Name)
		}
	}

	// Processes on the host against the records.
	procs := stateProcesses(f.c.StateDir)
	claimed := map[int]string{}
	for _, v := range final {
		if v.Processes == nil {
			continue
		}
		for what, pid := range map[string]int{"qemu": v.Processes.Qemu.Pid, "swtpm": v.Processes.Tpm.Pid} {
			claimed[pid] = v.ID
			p, ok := procs[pid]
			if !ok || p.vm != v.ID {
				inv.fail("records claiming processes that do not run", "%s (%s, %s) claims %s pid %d: %+v", v.ID, v.Name, v.State, what, pid, p)
			}
		}
		if !slices.Contains([]string{"booting", "attesting", "ready", "running", "stopping"}, v.State) {
			inv.fail("records claiming processes that do not run", "%s (%s) is %s and lists processes", v.ID, v.Name, v.State)
		}
	}
	for _, pid := range slices.Sorted(maps.Keys(procs)) {
		p := procs[pid]
		if claimed[pid] != p.vm {
			inv.fail("qemu/swtpm processes without a record", "%s pid %d of vm directory %s (record: %v)", p.kind, pid, p.vm, byID[p.vm].ID != "")
		}
	}
	for _, v := range final {
		if (v.State == "ready" || v.State == "running") && v.Processes == nil {
			inv.fail("records claiming processes that do not run", "%s (%s) is %s without processes", v.ID, v.Name, v.State)
		}
	}

	// Directories.
	dirs, _ := os.ReadDir(filepath.Join(f.c.StateDir, "vms"))
	onDisk := map[string]bool{}
	for _, d := range dirs {
		onDisk[d.Name()] = true
		if _, ok := byID[d.Name()]; !ok {
			inv.fail("vm directories without a record", "%s", d.Name())
		}
	}
	for _, v := range final {
		if st, err := os.Stat(v.Paths.Dir); err != nil || !st.IsDir() || !onDisk[v.ID] {
			inv.fail("records without their directory", "%s (%s, %s): %v", v.ID, v.Name, v.State, err)
		}
	}

	// Every VM works, or says why it does not.
	for _, v := range final {
		e := f.ledger[v.Name]
		switch v.State {
		case "ready", "running":
			if !f.execWorks(v) {
				inv.fail("ready/running VMs that do not answer exec", "%s (%s, %s, lastError %q)", v.ID, v.Name, v.State, v.LastError)
			}
			for _, fw := range v.Forwards {
				if line, err := sshBanner(fw.Address); err != nil || !strings.HasPrefix(line, "SSH-2.0-") {
					inv.fail("forwards of ready VMs not answering", "%s (%s) port %d at %s: %q %v", v.ID, v.Name, fw.Port, fw.Address, line, err)
				}
			}
		case "stopped":
			if v.LastError == "" && (e == nil || !e.stopAsked) {
				inv.fail("stopped/failed VMs without a reason", "%s (%s) is stopped, no stop was asked for, lastError empty", v.ID, v.Name)
			}
		case "failed":
			if v.LastError == "" {
				inv.fail("stopped/failed VMs without a reason", "%s (%s) failed without lastError", v.ID, v.Name)
			}
		case "suspended":
			if strings.HasPrefix(v.Name, "pool.") {
				f.checkParked(inv, v) // resuming it would take it out of the pool
				continue
			}
			f.checkSuspended(inv, v)
		default:
			inv.fail("VMs stuck in a transition", "%s (%s) is %s after the settle (lastError %q)", v.ID, v.Name, v.State, v.LastError)
		}
	}

	for _, v := range final {
		if v.State == "suspended" {
			continue
		}
		if _, err := os.Stat(filepath.Join(v.Paths.Dir, "suspend")); err == nil {
			inv.fail("saved states of VMs not suspended", "%s (%s, %s) keeps %s", v.ID, v.Name, v.State, filepath.Join(v.Paths.Dir, "suspend"))
		}
	}

	// Leases.
	r := f.call("GET", "/networks", "", 10*time.Second)
	var nets []struct {
		Spec struct {
			Name string `json:"name"`
		} `json:"spec"`
		Leases []struct {
			VMID string `json:"vmId"`
			IP   string `json:"ip"`
		} `json:"leases"`
	}
	if r.err != nil || r.code != 200 || json.Unmarshal(r.body, &nets) != nil {
		inv.fail("leases without a VM", "GET /networks: %d %v %s", r.code, r.err, r.body)
	}
	leaseOf := map[string]string{} // network/vm -> ip
	for _, n := range nets {
		for _, l := range n.Leases {
			leaseOf[n.Spec.Name+"/"+l.VMID] = l.IP
			if v, ok := byID[l.VMID]; !ok || v.Network != n.Spec.Name {
				inv.fail("leases without a VM", "network %s leases %s to %s", n.Spec.Name, l.IP, l.VMID)
			}
		}
	}
	for _, v := range final {
		if v.Network == "" {
			inv.fail("VMs without their lease", "%s (%s) has no network", v.ID, v.Name)
		} else if ip := leaseOf[v.Network+"/"+v.ID]; ip != v.IP {
			inv.fail("VMs without their lease", "%s (%s) has %s on %s, the network's lease is %q", v.ID, v.Name, v.IP, v.Network, ip)
		}
	}

	// Forwards of VMs that are gone.
	held := map[string]bool{}
	for _, v := range final {
		for _, fw := range v.Forwards {
			held[fw.Address] = true
		}
	}
	for _, e := range f.ledger {
		if _, exists := byName[e.name]; exists {
			continue
		}
		for addr := range e.forwards {
			if held[addr] {
				continue // the port went to another VM's forward since
			}
			if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
				conn.Close()
				inv.fail("forwards of deleted VMs still accepting", "%s of deleted %s (%s)", addr, e.name, e.id)
			}
		}
	}

	// Sockets.
	entries, _ := os.ReadDir(f.c.RunDir)
	for _, d := range entries {
		if d.Name() != "hypervisor.sock" && d.Name() != "attestation.sock" && d.Name() != "gateway.sock" {
			inv.fail("sockets in the run dir besides the services'", "%s", d.Name())
		}
	}

	// Golden values and pins.
	var pol struct {
		Document struct {
			Golden struct {
				SHA256 map[string]string `json:"sha256"`
			} `json:"golden"`
		} `json:"document"`
	}
	r = f.call("GET", "/images/"+faultsImage+"/policy", "", 10*time.Second)
	if r.err != nil || r.code != 200 || json.Unmarshal(r.body, &pol) != nil || !maps.Equal(pol.Document.Golden.SHA256, f.golden) {
		inv.fail("golden values changed", "policy of %s: %d %v %s", faultsImage, r.code, r.err, r.body)
	}
	for _, v := range final {
		if v.State != "ready" && v.State != "running" {
			continue // a boot interrupted before it ran may be unknown
		}
		// Attestation holds the verdicts of every running VM's boot: the
		// hypervisor begins each boot there (BeginBoot), and its boot
		// counter is the one the record carries.
		r := f.call("GET", "/vms/"+v.ID+"/attestation", "", 10*time.Second)
		var att struct {
			Boot json.Number `json:"boot"`
		}
		if r.err != nil || r.code != 200 || json.Unmarshal(r.body, &att) != nil {
			inv.fail("VMs whose boot attestation does not know", "%s (%s, %s): %d %v %s", v.ID, v.Name, v.State, r.code, r.err, bytes.TrimSpace(r.body))
		} else if v.Attestation.Boot != att.Boot {
			inv.fail("VMs whose boot attestation does not know", "%s (%s, %s): the record is at boot %q, attestation at %q", v.ID, v.Name, v.State, v.Attestation.Boot, att.Boot)
		}
	}
	for _, v := range final {
		// A VM that requires attestation and got as far as ready has had
		// its initrd quote verified: a kill of attestation between the
		// guest's nonce and its quote costs a retry, not the user-data.
		e := f.ledger[v.Name]
		if e == nil || !e.attest || (v.State != "ready" && v.State != "running") || v.Attestation.UserDataReleased {
			continue
		}
		verdict := "no initrd verdict"
		if q := v.Attestation.Initrd; q != nil {
			verdict = fmt.Sprintf("initrd verified %t: %q", q.Verified, q.Message)
		}
		inv.fail("attested VMs whose user-data stayed gated", "%s (%s, %s, boot %s): %s", v.ID, v.Name, v.State, v.Attestation.Boot, verdict)
	}
	for _, v := range final {
		e := f.ledger[v.Name]
		if e == nil || e.akPin == "" {
			continue
		}
		r := f.call("GET", "/vms/"+v.ID+"/attestation", "", 10*time.Second)
		if r.err != nil || r.code != 200 {
			inv.fail("AK pins lost or changed", "attestation of verified %s (%s): %d %v %s", v.ID, v.Name, r.code, r.err, r.body)
			continue
		}
		f.notePin(e) // a verified quote of the current boot with another AK is reported as unexpected
	}

	f.mu.Lock()
	for _, u := range f.unexpect {
		inv.fail("unexpected API errors", "%s", firstLineOf(u))
	}
	f.mu.Unlock()
	return inv
}

// checkSuspended: a suspended VM has its whole saved state, and resumes to
// a guest that answers exec (the processes are checked with the others:
// a suspended record lists none, so any QEMU of its directory is a stray).
func (f *faultRun) checkSuspended(inv *invariants, v vmJSONF) {
	for _, name := range []string{"state.bin", "manifest.json"} {
		if _, err := os.Stat(filepath.Join(v.Paths.Dir, "suspend", name)); err != nil {
			inv.fail("suspended VMs without their saved state", "%s (%s): %v", v.ID, v.Name, err)
			return
		}
	}
	r := f.call("POST", "/vms/"+v.ID+"/resume", "", 90*time.Second)
	if r.err != nil || r.code != 200 {
		inv.fail("suspended VMs that do not resume", "%s (%s): %d %v %s", v.ID, v.Name, r.code, r.err, firstLineOf(string(bytes.TrimSpace(r.body))))
		return
	}
	if !f.execWorks(v) {
		inv.fail("suspended VMs that do not resume", "%s (%s) resumed but does not answer exec", v.ID, v.Name)
	}
}

func firstLineOf(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i] + " …"
	}
	return s
}

// execWorks retries exec hostname for a little while: a VM that just became
// ready may still be bringing up SSH.
func (f *faultRun) execWorks(v vmJSONF) bool {
	deadline := time.Now().Add(f.execFor)
	for {
		r := f.call("POST", "/vms/"+v.ID+"/exec", `{"command":["hostname"]}`, 30*time.Second)
		var res execJSON
		if r.err == nil && r.code == 200 && json.Unmarshal(r.body, &res) == nil && res.Stdout == v.Name+"\n" {
			return true
		}
		if time.Now().After(deadline) {
			f.t.Logf("exec in %s (%s): %d %v %s", v.ID, v.Name, r.code, r.err, bytes.TrimSpace(r.body))
			return false
		}
		time.Sleep(3 * time.Second)
	}
}

// stopAll stops the three processes (SIGTERM; the hypervisor leaves its VMs
// running), so their bbolt files can be opened.
func (f *faultRun) stopAll() {
	for i := len(cluster.Services) - 1; i >= 0; i-- {
		f.c.StopServiceGracefully(cluster.Services[i], 30*time.Second) // SIGTERM
	}
}

// checkDatabases checks both bbolt files of the stopped services: tx.Check,
// and the records against what the API said.
func (f *faultRun) checkDatabases(final []vmJSONF, inv *invariants) {
	ids := map[string]vmJSONF{}
	for _, v := range final {
		ids[v.ID] = v
	}
	check := func(name string, fn func(tx *bolt.Tx)) {
		db, err := bolt.Open(filepath.Join(f.c.StateDir, name), 0o600, &bolt.Options{ReadOnly: true, Timeout: 5 * time.Second})
		if err != nil {
			inv.fail("bbolt check errors", "open %s: %v", name, err)
			return
		}
		defer db.Close()
		err = db.View(func(tx *bolt.Tx) error {
			for err := range tx.Check() {
				inv.fail("bbolt check errors", "%s: %v", name, err)
			}
			fn(tx)
			return nil
		})
		if err != nil {
			inv.fail("bbolt check errors", "%s: %v", name, err)
		}
	}
	check("hypervisor.db", func(tx *bolt.Tx) {
		seen := map[string]bool{}
		if b := tx.Bucket([]byte("vms")); b != nil {
			_ = b.ForEach(func(k, raw []byte) error {
				// The stored record (storepb, internal to the hypervisor)
				// shares its id and name field numbers with the API's message.
				rec := &hypervisorv1.VirtualMachine{}
				if err := proto.Unmarshal(raw, rec); err != nil {
					inv.fail("bbolt check errors", "hypervisor.db vms/%s: %v", k, err)
					return nil
				}
				seen[string(k)] = true
				if v, ok := ids[string(k)]; !ok || v.Name != rec.GetName() {
					inv.fail("database records differing from the API", "hypervisor.db has vm %s (%s), the API did not list it", k, rec.GetName())
				}
				return nil
			})
		}
		for id := range ids {
			if !seen[id] {
				inv.fail("database records differing from the API", "vm %s listed by the API is not in hypervisor.db", id)
			}
		}
		if b := tx.Bucket([]byte("attestation-forget")); b != nil {
			_ = b.ForEach(func(k, _ []byte) error {
				inv.fail("attestation records of deleted VMs", "hypervisor.db still queues vm %s for attestation to forget", k)
				return nil
			})
		}
		if b := tx.Bucket([]byte("networks")); b != nil {
			_ = b.ForEach(func(k, raw []byte) error {
				n := &hypervisorv1.Network{}
				if err := proto.Unmarshal(raw, n); err != nil {
					inv.fail("bbolt check errors", "hypervisor.db networks/%s: %v", k, err)
					return nil
				}
				for _, l := range n.GetLeases() {
					if v, ok := ids[l.GetVmId()]; !ok || v.IP != l.GetIp() {
						inv.fail("leases without a VM", "hypervisor.db network %s leases %s to %s", k, l.GetIp(), l.GetVmId())
					}
				}
				return nil
			})
		}
	})
	check("attestation.db", func(tx *bolt.Tx) {
		if b := tx.Bucket([]byte("policies")); b == nil || b.Get([]byte(faultsImage)) == nil {
			inv.fail("golden values changed", "attestation.db has no policy for %s", faultsImage)
		}
		b := tx.Bucket([]byte("vms"))
		if b == nil {
			inv.fail("bbolt check errors", "attestation.db has no vms bucket")
			return
		}
		_ = b.ForEach(func(k, raw []byte) error {
			var rec struct {
				AKFingerprint string `json:"akFingerprint"`
			}
			if err := json.Unmarshal(raw, &rec); err != nil {
				inv.fail("bbolt check errors", "attestation.db vms/%s: %v", k, err)
				return nil
			}
			v, ok := ids[string(k)]
			if !ok {
				inv.fail("attestation records of deleted VMs", "attestation.db keeps vm %s (pin %q)", k, rec.AKFingerprint)
				return nil
			}
			if e := f.ledger[v.Name]; e != nil && e.akPin != "" && rec.AKFingerprint != e.akPin {
				inv.fail("AK pins lost or changed", "attestation.db pins %q for %s (%s), verified with %s", rec.AKFingerprint, k, v.Name, e.akPin)
			}
			return nil
		})
		for _, v := range final {
			if e := f.ledger[v.Name]; e != nil && e.akPin != "" && b.Get([]byte(v.ID)) == nil {
				inv.fail("AK pins lost or changed", "attestation.db lost verified vm %s (%s)", v.ID, v.Name)
			}
		}
	})
}

// ---- host processes ---------------------------------------------------------

type stateProc struct {
	kind string // qemu or swtpm
	vm   string // the VM directory its argv references
}

// stateProcesses finds QEMU and swtpm processes whose argv references a VM
// directory below stateDir.
func stateProcesses(stateDir string) map[int]stateProc {
	out := map[int]stateProc{}
	prefix := filepath.Join(stateDir, "vms") + "/"
	ents, _ := os.ReadDir("/proc")
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile("/proc/" + d.Name() + "/cmdline")
		if err != nil || len(raw) == 0 {
			continue
		}
		if st, err := os.ReadFile("/proc/" + d.Name() + "/stat"); err == nil {
			if i := bytes.LastIndexByte(st, ')'); i >= 0 && bytes.HasPrefix(bytes.TrimSpace(st[i+1:]), []byte("Z")) {
				continue // exited, not yet reaped
			}
		}
		argv := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		base := filepath.Base(argv[0])
		kind := ""
		switch {
		case strings.HasPrefix(base, "qemu-system"):
			kind = "qemu"
		case strings.HasPrefix(base, "swtpm"):
			kind = "swtpm"
		default:
			continue
		}
		joined := strings.Join(argv, " ")
		i := strings.Index(joined, prefix)
		if i < 0 {
			continue
		}
		id := joined[i+len(prefix):]
		if j := strings.IndexAny(id, "/ ,"); j >= 0 {
			id = id[:j]
		}
		out[pid] = stateProc{kind: kind, vm: id}
	}
	return out
}

// killStateProcesses ends what the test's hypervisors left running (by PID,
// found through the test's own state directory).
func killStateProcesses(stateDir string) {
	for pid := range stateProcesses(stateDir) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// keepLogs copies the services' logs of a failed run out of the cluster's
// directory (which the cleanup removes).
func keepLogs(t *testing.T, c *cluster.Cluster, seed int64) {
	dst := filepath.Join(os.TempDir(), fmt.Sprintf("vmm-faults-%d", seed))
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return
	}
	for _, s := range cluster.Services {
		if b, err := os.ReadFile(filepath.Join(c.Dir, s+".log")); err == nil {
			_ = os.WriteFile(filepath.Join(dst, s+".log"), b, 0o644)
		}
	}
	t.Logf("service logs kept in %s", dst)
}

func total(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func fmtCounts(m map[string]int) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(out, ", ")
}
