package ocirun

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"github.com/giantswarm/vm-manager/pkg/ociboot"
)

// EntrypointPrefix starts each console line of the entrypoint's output
// (stdout and stderr alike), so a host test can pick them out.
const EntrypointPrefix = "[entrypoint] "

// Root is a mounted OCI root: its merged directory, its config and the
// identity its processes run with.
type Root struct {
	Dir      string // the overlay: what processes are chrooted into
	Config   ociboot.Config
	Identity Identity
	Argv     []string // entrypoint + cmd; nil when the image names neither
	argvErr  error

	logf     func(format string, args ...any)
	startCmd func(*exec.Cmd) (func(), error)
	etc      string   // where the network files are written
	busybox  *os.File // the shell of an image without /bin/sh
	noShell  sync.Once
}

func newRoot(o *Options, dir string, cfg ociboot.Config) (*Root, error) {
	id, err := NewIdentity(dir, cfg)
	if err != nil {
		return nil, err
	}
	// A working directory the image lacks is made, as Docker does.
	if wd, err := ResolveIn(dir, id.Dir); err != nil {
		return nil, err
	} else if err := os.MkdirAll(wd, 0o755); err != nil {
		return nil, fmt.Errorf("working directory %s: %w", id.Dir, err)
	}
	r := &Root{Dir: dir, Config: cfg, Identity: id, logf: o.Logf, startCmd: o.StartCmd, etc: filepath.Join(o.Dir, "etc")}
	r.Argv, r.argvErr = Argv(cfg)
	if f, err := os.Open(o.Busybox); err == nil {
		r.busybox = f // kept open: exec sessions run it through /proc/self/fd
	}
	groups := ""
	if len(id.User.Groups) > 0 {
		groups = fmt.Sprintf(" (groups %v)", id.User.Groups)
	}
	o.Logf("OCI root: runs as uid %d gid %d%s in %s", id.User.UID, id.User.GID, groups, id.Dir)
	return r, nil
}

// SetNetwork gives the root the guest's resolver and a hosts file, bound
// over its /etc/resolv.conf and /etc/hosts as runtimes do (made when the
// image lacks them). Without DNS servers the image's resolv.conf stays.
func (r *Root) SetNetwork(dns []net.IP, hostname string) {
	if err := os.MkdirAll(r.etc, 0o755); err != nil {
		r.logf("warning: OCI root: %v", err)
		return
	}
	hosts := "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
	if hostname != "" {
		hosts += "127.0.1.1\t" + hostname + "\n"
	}
	files := map[string]string{"hosts": hosts}
	if len(dns) > 0 {
		var b strings.Builder
		for _, ip := range dns {
			fmt.Fprintf(&b, "nameserver %s\n", ip)
		}
		files["resolv.conf"] = b.String()
	}
	for name, content := range files {
		src := filepath.Join(r.etc, name)
		if err := os.WriteFile(src, []byte(content), 0o644); err != nil {
			r.logf("warning: OCI root: %v", err)
			continue
		}
		if err := bindFile(r.Dir, "/etc/"+name, src); err != nil {
			r.logf("warning: OCI root: %v", err)
		}
	}
}

// Command is an exec session's command inside the root (sshd.Server's
// Command): the shell with args ("-c <command>", or none for a login
// shell), as the image's user, in its directory, with its environment and
// then the session's. The shell is the image's /bin/sh; an image without
// one gets vm-agent's busybox sh, run from outside through its open file,
// still chrooted.
func (r *Root) Command(ctx context.Context, args, env []string) (*exec.Cmd, error) {
	path, argv0 := "/bin/sh", "/bin/sh"
	var extra []*os.File
	if executableIn(r.Dir, path) != nil {
		if r.busybox == nil {
			return nil, fmt.Errorf("the image has no /bin/sh and vm-agent no busybox")
		}
		r.noShell.Do(func() { r.logf("OCI root: the image has no /bin/sh: exec sessions use vm-agent's busybox sh in it") })
		path, argv0, extra = "/proc/self/fd/3", "sh", []*os.File{r.busybox}
	}
	cmd := r.Identity.Command(ctx, r.Dir, path, append([]string{argv0}, args...), env)
	cmd.ExtraFiles = extra
	return cmd, nil
}

// Entrypoint returns the supervisor of the image's entrypoint, not yet
// running (nil when the image names none, which the console says). Its
// output goes to line, each line starting with EntrypointPrefix.
func (r *Root) Entrypoint(line func(string)) *Supervisor {
	if r.argvErr != nil {
		r.logf("entrypoint refused: %v", r.argvErr)
		return nil
	}
	r.logf("entrypoint: %q", r.Argv)
	return &Supervisor{
		Name: "entrypoint",
		Logf: r.logf,
		Start: func() (Instance, error) {
			path, err := lookPath(r.Dir, r.Argv[0], Getenv(r.Identity.Env, "PATH"), r.Identity.Dir)
			if err != nil {
				return nil, err
			}
			cmd := r.Identity.Command(context.Background(), r.Dir, path, r.Argv, nil)
			return startProc(cmd, r.startCmd, EntrypointPrefix, line)
		},
	}
}
