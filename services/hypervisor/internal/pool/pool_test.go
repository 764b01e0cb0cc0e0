package pool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore"
)

// fakeVMs boots members that park when the test says so.
type fakeVMs struct {
	mu       sync.Mutex
	n        int
	members  map[string]*vm.Member
	park     map[string]chan error // WaitParked's answer
	booting  int                   // members between create and park
	maxBoots int                   // the most booting at once
	deleted  []string
	dir      string
}

func newFakeVMs(dir string) *fakeVMs {
	return &fakeVMs{members: map[string]*vm.Member{}, park: map[string]chan error{}, dir: dir}
}

func (f *fakeVMs) PoolShape(req *hypervisorv1.CreatePoolRequest) (*hypervisorv1.PoolShape, error) {
	if req.GetImage() == "nope" {
		return nil, apierr.Invalidf("image", "unknown image")
	}
	return &hypervisorv1.PoolShape{Image: req.GetImage(), Cpus: req.GetCpus()}, nil
}

func (f *fakeVMs) CreateMember(_ context.Context, pool string, _ *hypervisorv1.PoolShape) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
	id := fmt.Sprintf("%08x", f.n)
	f.members[id] = &vm.Member{ID: id, Pool: pool, State: hypervisorv1.State_STATE_BOOTING, Dir: filepath.Join(f.dir, id)}
	f.park[id] = make(chan error, 1)
	f.booting++
	f.maxBoots = max(f.maxBoots, f.booting)
	return id, nil
}

func (f *fakeVMs) WaitParked(ctx context.Context, id string) error {
	f.mu.Lock()
	ch := f.park[id]
	f.mu.Unlock()
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (f *fakeVMs) Park(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.members[id].State = hypervisorv1.State_STATE_SUSPENDED
	f.booting--
	return nil
}

func (f *fakeVMs) Members(pool string) []vm.Member {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []vm.Member
	for _, id := range slices.Sorted(maps.Keys(f.members)) {
		if m := f.members[id]; pool == "" || m.Pool == pool {
			out = append(out, *m)
		}
	}
	return out
}

func (f *fakeVMs) Delete(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	m := f.members[id]
	if m == nil {
		return apierr.Errorf(apierr.NotFound, "vm %s not found", id)
	}
	if m.State == hypervisorv1.State_STATE_BOOTING {
		f.booting--
	}
	delete(f.members, id)
	f.deleted = append(f.deleted, id)
	return nil
}

// answer parks (nil) or fails the boot of every member waiting to park.
func (f *fakeVMs) answer(err error) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for id, m := range f.members {
		if m.State == hypervisorv1.State_STATE_BOOTING && len(f.park[id]) == 0 {
			f.park[id] <- err
			n++
		}
	}
	return n
}

func (f *fakeVMs) states() (ready, booting int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, m := range f.members {
		if m.State == hypervisorv1.State_STATE_SUSPENDED {
			ready++
		} else {
			booting++
		}
	}
	return
}

func run(t *testing.T, cfg Config) (*Pools, *fakeVMs, *vmstore.Store) {
	t.Helper()
	dir := t.TempDir()
	st, err := vmstore.Open(filepath.Join(dir, "hypervisor.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	p, err := New(cfg, slog.New(slog.DiscardHandler), st)
	if err != nil {
		t.Fatal(err)
	}
	f := newFakeVMs(dir)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx, f) }()
	t.Cleanup(func() { cancel(); <-done })
	poll.Until(t, "the refill loop runs", func() bool { return p.members() != nil })
	return p, f, st
}

// A pool fills to its size one boot at a time (the default budget), counts
// its refills, and a failed boot is deleted, recorded and retried later.
func TestRefillOneBootAtATime(t *testing.T) {
	p, f, _ := run(t, Config{Retry: 50 * time.Millisecond})
	if _, err := p.Create(&hypervisorv1.CreatePoolRequest{Name: "small", Size: 3, Image: "test_1"}); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the first failed member is deleted", func() bool {
		f.answer(errors.New("its initrd quote was rejected"))
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.deleted) == 1
	})
	if pl, _ := p.Get("small"); pl.GetStatus().GetRefillFailuresTotal() != 1 || pl.GetStatus().GetLastError() == "" {
		t.Errorf("after a failure: %v", pl.GetStatus())
	}
	poll.Until(t, "three members parked", func() bool {
		f.answer(nil)
		ready, _ := f.states()
		return ready == 3
	})
	pl, _ := p.Get("small")
	st := pl.GetStatus()
	if st.GetReady() != 3 || st.GetFilling() != 0 || st.GetRefillsTotal() != 3 || st.GetLastError() != "" || len(st.GetMembers()) != 3 {
		t.Errorf("status %v", st)
	}
	if f.maxBoots != 1 {
		t.Errorf("%d members booted at once, the budget is 1", f.maxBoots)
	}
	// A shrink deletes ready members beyond the size.
	if _, err := p.Resize(context.Background(), "small", 1); err != nil {
		t.Fatal(err)
	}
	if ready, _ := f.states(); ready != 1 {
		t.Errorf("%d ready after a shrink to 1", ready)
	}
	// Delete removes the pool and its members.
	resp, err := p.Delete(context.Background(), "small")
	if err != nil || resp.GetMembersDeleted() != 1 {
		t.Fatalf("delete: %v %v", resp, err)
	}
	if ready, booting := f.states(); ready+booting != 0 {
		t.Errorf("members left: %d ready, %d booting", ready, booting)
	}
}

// The disk quota stops refills, and says why; the pools survive a restart.
func TestDiskQuotaAndRestart(t *testing.T) {
	p, f, st := run(t, Config{DiskBytes: 1, Retry: time.Hour})
	full := t.TempDir() // a member's directory that holds a block
	if err := os.WriteFile(filepath.Join(full, "state"), []byte("saved RAM"), 0o600); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	f.members["ffffffff"] = &vm.Member{ID: "ffffffff", Pool: "big", State: hypervisorv1.State_STATE_SUSPENDED, Dir: full}
	f.mu.Unlock()
	if _, err := p.Create(&hypervisorv1.CreatePoolRequest{Name: "big", Size: 2, Image: "test_1"}); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the refill is refused at the quota", func() bool { return p.RefusedAtDiskQuota() > 0 })
	if pl, _ := p.Get("big"); pl.GetStatus().GetFilling() != 0 || pl.GetStatus().GetLastError() == "" {
		t.Errorf("status %v", pl.GetStatus())
	}
	for _, c := range []struct {
		req  *hypervisorv1.CreatePoolRequest
		code apierr.Code
	}{
		{&hypervisorv1.CreatePoolRequest{Name: "big", Size: 1, Image: "other"}, apierr.Conflict},
		{&hypervisorv1.CreatePoolRequest{Name: "same-shape", Size: 1, Image: "test_1"}, apierr.Conflict},
		{&hypervisorv1.CreatePoolRequest{Name: "Bad_Name", Size: 1}, apierr.InvalidRequest},
		{&hypervisorv1.CreatePoolRequest{Name: "huge", Size: 17}, apierr.InvalidRequest},
		{&hypervisorv1.CreatePoolRequest{Name: "img", Size: 1, Image: "nope"}, apierr.InvalidRequest},
	} {
		if _, err := p.Create(c.req); apierr.CodeOf(err) != c.code {
			t.Errorf("create %v: %v, want %s", c.req, err, c.code)
		}
	}
	again, err := New(Config{}, slog.New(slog.DiscardHandler), st)
	if err != nil {
		t.Fatal(err)
	}
	if l := again.List(); len(l) != 1 || l[0].GetName() != "big" || l[0].GetSize() != 2 || l[0].GetShape().GetImage() != "test_1" {
		t.Errorf("pools after a restart: %v", l)
	}
}
