package execstream

import (
	"strings"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/sshexec"
)

// Bounds of a start message and of the terminal.
const (
	MaxEnv           = 64
	MaxEnvNameBytes  = 256
	MaxEnvValueBytes = 32 << 10
	MaxTermSize      = 10000
	DefaultTerm      = "xterm"
	DefaultRows      = 24
	DefaultCols      = 80
)

// signals are the names a client may send: RFC 4254 §6.10's and the job
// control ones a terminal user expects.
var signals = map[string]bool{
	"ABRT": true, "ALRM": true, "FPE": true, "HUP": true, "ILL": true, "INT": true, "KILL": true,
	"PIPE": true, "QUIT": true, "SEGV": true, "TERM": true, "USR1": true, "USR2": true,
	"CONT": true, "STOP": true, "TSTP": true, "WINCH": true,
}

// startOptions checks a start message once, at the edge.
func startOptions(st *hypervisorv1.ExecStart) (sshexec.StreamOptions, error) {
	var opts sshexec.StreamOptions
	if st.GetId() == "" {
		return opts, apierr.Invalidf("id", "start.id is required")
	}
	for i, w := range st.GetCommand() {
		if strings.ContainsRune(w, 0) {
			return opts, apierr.Invalidf("command", "command[%d] contains a NUL byte", i)
		}
	}
	opts.Argv = st.GetCommand()
	if n := len(st.GetEnv()); n > MaxEnv {
		return opts, apierr.Invalidf("env", "%d env entries, at most %d", n, MaxEnv)
	}
	for k, v := range st.GetEnv() {
		if k == "" || len(k) > MaxEnvNameBytes || strings.ContainsAny(k, "=\x00") {
			return opts, apierr.Invalidf("env", "env name %q: want 1..%d bytes without '=' or NUL", k, MaxEnvNameBytes)
		}
		if len(v) > MaxEnvValueBytes || strings.ContainsRune(v, 0) {
			return opts, apierr.Invalidf("env", "env %s: the value must be at most %d bytes without NUL", k, MaxEnvValueBytes)
		}
	}
	opts.Env = st.GetEnv()
	if p := st.GetPty(); p != nil {
		term := p.GetTerm()
		if term == "" {
			term = DefaultTerm
		}
		if len(term) > 64 || strings.Trim(term, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.+-_") != "" {
			return opts, apierr.Invalidf("pty.term", "term %q: want a terminfo name (letters, digits, . + - _; at most 64)", term)
		}
		rows, cols := p.GetRows(), p.GetCols()
		if rows == 0 {
			rows = DefaultRows
		}
		if cols == 0 {
			cols = DefaultCols
		}
		if rows > MaxTermSize || cols > MaxTermSize {
			return opts, apierr.Invalidf("pty", "pty %dx%d: rows and cols must be at most %d", rows, cols, MaxTermSize)
		}
		opts.Pty = &sshexec.Pty{Term: term, Rows: rows, Cols: cols}
	}
	return opts, nil
}

func checkResize(ws *hypervisorv1.ExecWindowSize, pty bool) error {
	if !pty {
		return apierr.Invalidf("resize", "resize needs a pty session (start.pty)")
	}
	if r, c := ws.GetRows(), ws.GetCols(); r < 1 || c < 1 || r > MaxTermSize || c > MaxTermSize {
		return apierr.Invalidf("resize", "resize %dx%d: rows and cols must be within 1..%d", r, c, MaxTermSize)
	}
	return nil
}

func checkSignal(name string) error {
	if !signals[name] {
		return apierr.Invalidf("signal", "signal %q: want one of ABRT ALRM CONT FPE HUP ILL INT KILL PIPE QUIT SEGV STOP TERM TSTP USR1 USR2 WINCH", name)
	}
	return nil
}
