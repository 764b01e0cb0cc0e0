package sshd

import (
	"context"
	"os"
	"os/exec"
)

// command is the session's command before its I/O is set up: Server.Command's
// when set (an OCI boot runs sessions inside the image), else Shell in Dir
// with BaseEnv and the client's env.
func (s *Server) command(ctx context.Context, args, env []string) (*exec.Cmd, error) {
	if s.Command != nil {
		return s.Command(ctx, args, env)
	}
	shell := s.Shell
	if shell == "" {
		shell = DefaultShell
	}
	cmd := exec.CommandContext(ctx, shell, args...)
	cmd.Env = append(append([]string(nil), BaseEnv...), env...)
	cmd.Dir = "/"
	if fi, err := os.Stat(s.Dir); err == nil && fi.IsDir() {
		cmd.Dir = s.Dir
	}
	return cmd, nil
}
