package verify

import (
	"bytes"
	"crypto/sha256"
	"fmt"

	"github.com/google/go-eventlog/register"
	"github.com/google/go-eventlog/tcg"

	"github.com/giantswarm/vm-manager/pkg/measure"
)

// TypeUserspace is the Type of events from the userspace log (systemd's
// tpm2-measure.log, which vm-agent writes); it has no TCG event types.
const TypeUserspace = "userspace"

// replayLogs replays the firmware log (fw) and the userspace log (us)
// against the quoted PCRs. A PCR holds its firmware-log events, then its
// userspace-log events, extended from zero: on a UKI boot systemd-stub logs
// its PCR 11 events in the firmware log, and vm-agent logs the boot phases
// it extends after them in the userspace log. Only quoted PCRs are checked,
// and, as go-eventlog does, a quoted PCR that neither log mentions is not.
//
// When the userspace log does not parse or replay, the firmware log is
// replayed alone, as before userspace logs were read: if it replays, its
// events are returned together with the error (a direct-kernel boot's
// firmware events do not depend on vm-agent's log).
func replayLogs(fw, us []byte, pcrs map[uint32][]byte) ([]Event, error) {
	var el *tcg.EventLog
	if len(fw) > 0 {
		var err error
		if el, err = parseFirmwareLog(fw); err != nil {
			return nil, err
		}
	}
	if len(us) == 0 {
		if el == nil {
			return nil, nil
		}
		return replayFirmware(el, pcrs)
	}
	evs, uerr := replayWithUserspace(el, us, pcrs)
	if uerr == nil || el == nil {
		return evs, uerr
	}
	evs, ferr := replayFirmware(el, pcrs)
	if ferr != nil {
		return nil, fmt.Errorf("%v; %v", uerr, ferr)
	}
	return evs, fmt.Errorf("%v; the event log replays without it, its events are kept", uerr)
}

// replayWithUserspace replays both logs; el may be nil (no firmware log).
func replayWithUserspace(el *tcg.EventLog, us []byte, pcrs map[uint32][]byte) ([]Event, error) {
	parsed, err := measure.ParseLog(us) // bounded: measure.MaxLogRecords, MaxWordBytes
	if err != nil {
		return nil, fmt.Errorf("userspace log does not parse: %v", err)
	}
	var uev []Event
	// start is each touched PCR's value after its firmware-log events.
	start := map[uint32][]byte{}
	for _, e := range parsed {
		if _, quoted := pcrs[e.PCR]; !quoted {
			continue // cannot be checked
		}
		start[e.PCR] = nil
		uev = append(uev, Event{PCR: e.PCR, Type: TypeUserspace, Description: clip(e.Description), Digest: bytes.Clone(e.Digest)})
	}
	if err := foldFirmware(el, start); err != nil {
		return nil, err
	}
	end := map[uint32][]byte{}
	for p, v := range start {
		end[p] = v
	}
	for _, e := range uev {
		end[e.PCR] = measure.Extend(end[e.PCR], e.Digest)
	}
	var bad []int
	for _, p := range sortedKeys(end) {
		if !bytes.Equal(end[p], pcrs[p]) {
			bad = append(bad, int(p))
		}
	}
	if len(bad) > 0 {
		after := ""
		if el != nil {
			after = " after the event log's events of those pcrs"
		}
		return nil, fmt.Errorf("userspace log does not replay to the quoted value of pcrs %s%s", joinInts(bad), after)
	}
	if el == nil {
		return uev, nil
	}
	// go-eventlog replays the firmware log as ever, but for the touched
	// PCRs to where the userspace log takes over: the fold above and
	// go-eventlog's (localities, H-CRTM) must agree, or nothing replays.
	values := make(map[uint32][]byte, len(pcrs))
	for p, v := range pcrs {
		values[p] = v
	}
	for p, v := range start {
		values[p] = v
	}
	fev, err := replayFirmware(el, values)
	if err != nil {
		return nil, err
	}
	return append(fev, uev...), nil
}

// foldFirmware sets start[p], for every p in start, to the firmware log's
// events of p extended from zero (el nil: zero). An event without a sha256
// digest fails it, as it fails go-eventlog's replay. One pass over the log.
func foldFirmware(el *tcg.EventLog, start map[uint32][]byte) error {
	for p := range start {
		start[p] = measure.Zero()
	}
	if el == nil {
		return nil
	}
	for _, e := range el.Events(register.HashSHA256) {
		if e.Index < 0 || e.Type == tcg.NoAction {
			continue // EV_NO_ACTION extends nothing
		}
		v, ok := start[uint32(e.Index)]
		if !ok {
			continue
		}
		if len(e.Digest) != sha256.Size {
			return fmt.Errorf("event log has a pcr %d event without a sha256 digest", e.Index)
		}
		start[uint32(e.Index)] = measure.Extend(v, e.Digest)
	}
	return nil
}
