package notify

import (
	"bytes"
	"context"
	"net"
	"strings"
	"testing"
)

// FuzzNotify feeds arbitrary bytes, cut into arbitrary reads, through the
// NUL framing of the virtio-serial transport and the sd_notify parser, and
// through the router. The framer must agree with a plain split on NUL
// whatever the read boundaries, every message must parse or fail cleanly, and
// the router's counters must account for every message.
func FuzzNotify(f *testing.F) {
	for _, s := range []struct {
		data   string
		cuts   string
		repeat uint16
	}{
		{"READY=1\x00", "", 0},
		{"READY=1\nSTATUS=up and running\n\x00", "\x03\x01", 0},
		{"STATUS=installing\x00STATUS=booting\x00READY=1\x00", "\x05", 0},
		{"READY=1\nGARBAGE\x00=1\x00", "", 0},
		{"\x00\x00\x00", "", 0},
		{"X_KEY=a=b\nSTATUS=\x00", "\x00", 0},
		{"STATUS=\xff\xfe\x00", "", 0},
		{"x", "", 1 << 15},                  // an unterminated oversize message
		{"STATUS=aaaaaaaa\n", "\xff", 5000}, // 80 KiB in one message
		{"READY=1\x00", "", 20},             // more than a subscriber buffer holds
	} {
		f.Add([]byte(s.data), []byte(s.cuts), s.repeat)
	}
	f.Fuzz(func(t *testing.T, data, cuts []byte, repeat uint16) {
		stream := data
		if repeat > 0 && len(data) > 0 {
			stream = bytes.Repeat(data, min(int(repeat), 4*MaxMessage/len(data)+1))
		}
		chunks := cut(stream, cuts)

		// The framer against a plain split, whatever the read boundaries.
		var f framer
		var got [][]byte
		over := 0
		for _, c := range chunks {
			f.feed(c, func(m []byte) { got = append(got, bytes.Clone(m)) }, func() { over++ })
		}
		want, wantOver := reference(stream)
		if len(got) != len(want) || over != wantOver {
			t.Fatalf("framer: %d messages, %d oversize; want %d, %d", len(got), over, len(want), wantOver)
		}
		for i := range got {
			if !bytes.Equal(got[i], want[i]) {
				t.Fatalf("message %d: %.60q, want %.60q", i, got[i], want[i])
			}
		}

		// Every message parses or fails cleanly (the whole stream too, as
		// one vsock connection would carry it).
		parse := func(m []byte) (Message, bool) {
			msg, err := Parse(m)
			if (err != nil) != invalid(m) {
				t.Fatalf("Parse(%.60q): err %v, want error %v", m, err, invalid(m))
			}
			if err == nil {
				checkMessage(t, m, msg)
			}
			return msg, err == nil
		}
		parse(stream)
		empty := 0
		for _, m := range got {
			if msg, ok := parse(m); ok && len(msg.Fields) == 0 {
				empty++
			}
		}

		// The router accounts for every framed message.
		r := NewRouter()
		ch, stop := r.Subscribe("vm")
		defer stop()
		for _, m := range got {
			r.deliverRaw("vm", m, true)
		}
		st := r.Stats()
		if int(st.Delivered+st.Dropped+st.Malformed)+empty != len(got) || st.Oversize != 0 || st.Unrouted != 0 {
			t.Fatalf("router stats %+v for %d messages (%d empty)", st, len(got), empty)
		}
		for range min(int(st.Delivered), SubscriberBuffer) {
			if m := <-ch; !m.Privileged {
				t.Fatal("a serial message lost its privilege")
			}
		}

		// And the real read loop over a connection, with the same cuts.
		if len(chunks) <= 64 {
			serial(t, chunks, len(got)-int(st.Malformed)-empty, wantOver)
		}
	})
}

// cut splits b into reads whose sizes come from cuts (cyclically); no cuts
// is one read.
func cut(b, cuts []byte) [][]byte {
	if len(cuts) == 0 {
		return [][]byte{b}
	}
	var out [][]byte
	for i := 0; len(b) > 0; i++ {
		n := min(len(b), int(cuts[i%len(cuts)])*97+1)
		out = append(out, b[:n])
		b = b[n:]
	}
	return out
}

// reference frames b by splitting on NUL: each terminated message up to
// MaxMessage is kept, longer ones (the unterminated tail too) are oversize.
func reference(b []byte) ([][]byte, int) {
	parts := bytes.Split(b, []byte{0})
	var msgs [][]byte
	over := 0
	for i, p := range parts {
		switch {
		case len(p) > MaxMessage:
			over++
		case i < len(parts)-1:
			msgs = append(msgs, p)
		}
	}
	return msgs, over
}

// invalid is Parse's rule, restated: too long, or a non-empty line without
// '=' or with an empty key.
func invalid(b []byte) bool {
	if len(b) > MaxMessage {
		return true
	}
	for _, line := range bytes.Split(b, []byte{'\n'}) {
		if len(line) > 0 && bytes.IndexByte(line, '=') <= 0 {
			return true
		}
	}
	return false
}

func checkMessage(t *testing.T, raw []byte, m Message) {
	t.Helper()
	if m.Ready != (m.Fields["READY"] == "1") || m.Status != m.Fields["STATUS"] || m.Privileged {
		t.Fatalf("Parse(%.60q) = %+v: Ready/Status disagree with Fields", raw, m)
	}
	for k, v := range m.Fields {
		if k == "" || strings.ContainsAny(k, "=\n") || strings.Contains(v, "\n") {
			t.Fatalf("Parse(%.60q): field %q=%q", raw, k, v)
		}
		if !bytes.Contains(raw, []byte(k+"="+v)) {
			t.Fatalf("Parse(%.60q): field %q=%q is not in the input", raw, k, v)
		}
	}
}

// serial writes chunks to readSerial over an in-memory connection and
// checks what the router saw.
func serial(t *testing.T, chunks [][]byte, wantMsgs, wantOver int) {
	t.Helper()
	r := NewRouter()
	ch, stop := r.Subscribe("vm")
	defer stop()
	client, server := net.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.readSerial(context.Background(), "vm", server)
	}()
	received := 0
	for _, c := range chunks {
		if _, err := client.Write(c); err != nil {
			t.Fatalf("write: %v", err)
		}
		for drained := false; !drained; {
			select {
			case <-ch:
				received++
			default:
				drained = true
			}
		}
	}
	client.Close()
	<-done
	for drained := false; !drained; {
		select {
		case <-ch:
			received++
		default:
			drained = true
		}
	}
	st := r.Stats()
	if received+int(st.Dropped) != wantMsgs || int(st.Oversize) != wantOver {
		t.Fatalf("serial: received %d, dropped %d, oversize %d; want %d messages, %d oversize (%+v)", received, st.Dropped, st.Oversize, wantMsgs, wantOver, st)
	}
}
