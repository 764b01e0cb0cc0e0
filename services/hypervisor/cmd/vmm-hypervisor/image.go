package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/pkg/logging"
	"github.com/giantswarm/vm-manager/pkg/statedir"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestimage"
)

// imageArgs carries the positional arguments of "image push" and "image
// pull". pkg/cli dispatches on one word and refuses positional arguments, so
// "image <sub> ARGS… FLAGS…" becomes the command "image <sub>" with only the
// flags, and the rest lands here.
type imageArgs struct{ args []string }

// split rewrites args when they start with "image <sub>". It knows which
// flags take a value from the command's own flag set, so "--image-dir DIR"
// and "--image-dir=DIR" both work, before or after the arguments.
func (ia *imageArgs) split(args []string, cmds []cli.Command) []string {
	if len(args) < 2 || args[0] != "image" {
		return args
	}
	name := "image " + args[1]
	var cmd *cli.Command
	for i := range cmds {
		if cmds[i].Name == name {
			cmd = &cmds[i]
		}
	}
	if cmd == nil {
		return append([]string{name}, args[2:]...) // "unknown command" names both words
	}
	probe := cli.New(name, "")
	probe.SetOutput(io.Discard)
	cmd.Setup(probe)

	out := []string{name}
	rest := args[2:]
	for i := 0; i < len(rest); i++ {
		a := rest[i]
		switch {
		case a == "--":
			ia.args = append(ia.args, rest[i+1:]...)
			return out
		case a == "-" || !strings.HasPrefix(a, "-"):
			ia.args = append(ia.args, a)
			continue
		}
		out = append(out, a)
		fname := strings.TrimLeft(a, "-")
		if strings.Contains(fname, "=") {
			continue
		}
		if f := probe.Lookup(fname); f != nil && !isBool(f) && i+1 < len(rest) {
			i++
			out = append(out, rest[i])
		}
	}
	return out
}

func isBool(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

func imagePushCommand(ia *imageArgs, stdout io.Writer) cli.Command {
	return cli.Command{
		Name:  "image push",
		Usage: "<dir> <ref>: publish an image directory as a guest image OCI artifact (<ref>: registry/repository:tag)",
		Setup: func(fs *cli.FlagSet) func(context.Context) error {
			imageDir := fs.String("image-dir", "VM_MANAGER_IMAGE_DIR", "", "image directory to publish, when not given as the first argument")
			plain := fs.Bool("plain-http", "VM_MANAGER_REGISTRY_PLAIN_HTTP", false, "talk HTTP, not HTTPS, to the registry (lab registries)")
			layout := fs.String("oci-layout", "VM_MANAGER_OCI_LAYOUT", "", "write into this OCI image layout directory instead of a registry; <ref> is then the tag")
			logger := logging.Flags(fs, "warn", "hypervisor")
			return func(ctx context.Context) error {
				var dir, ref string
				switch {
				case len(ia.args) == 2:
					dir, ref = ia.args[0], ia.args[1]
				case len(ia.args) == 1 && *imageDir != "":
					dir, ref = *imageDir, ia.args[0]
				default:
					return fmt.Errorf("want <dir> <ref> (or <ref> with --image-dir), got %q", ia.args)
				}
				log, err := logger()
				if err != nil {
					return err
				}
				files, err := guestimage.Files(dir)
				if err != nil {
					return err
				}
				var digest string
				if *layout != "" {
					digest, err = guestimage.PushLayout(ctx, dir, *layout, ref, guestimage.Options{Log: log})
				} else {
					digest, err = guestimage.Push(ctx, dir, ref, guestimage.Options{PlainHTTP: *plain, Log: log})
				}
				if err != nil {
					return err
				}
				fmt.Fprintf(stdout, "reference: %s\ndigest: %s\nfiles:\n", ref, digest)
				for _, f := range files {
					fmt.Fprintf(stdout, "  %s\n", f)
				}
				return nil
			}
		},
	}
}

func imagePullCommand(ia *imageArgs, stdout io.Writer) cli.Command {
	return catalogCommand(ia, "image pull", "<ref>: install a guest image OCI artifact (registry/repository:tag or @sha256:…) into the image directory",
		"image directory to install into (default <state-dir>/images)", func(fs *cli.FlagSet) func(ctx context.Context, ref, dir string) error {
			plain := fs.Bool("plain-http", "VM_MANAGER_REGISTRY_PLAIN_HTTP", false, "talk HTTP, not HTTPS, to the registry (lab registries)")
			logger := logging.Flags(fs, "warn", "hypervisor")
			return func(ctx context.Context, ref, dir string) error {
				log, err := logger()
				if err != nil {
					return err
				}
				res, err := guestimage.Pull(ctx, ref, dir, guestimage.Options{PlainHTTP: *plain, Log: log})
				if err != nil {
					return err
				}
				status := "pulled"
				if res.Unchanged {
					status = "unchanged (the marker already holds this digest)"
				}
				fmt.Fprintf(stdout, "reference: %s\ndigest: %s\nimage-dir: %s\nstatus: %s\nfiles:\n", ref, res.Digest, dir, status)
				for _, f := range res.Files {
					fmt.Fprintf(stdout, "  %s\n", f)
				}
				return nil
			}
		})
}

// catalogCommand is an image command on one <ref> in the image directory,
// pull or measure: it defines --state-dir and --image-dir (described by
// imageHelp; default <state-dir>/images, as serve's), and setup the
// command's own flags as cli.Command.Setup does. What setup returns runs
// with the ref and the directory.
func catalogCommand(ia *imageArgs, name, usage, imageHelp string, setup func(fs *cli.FlagSet) func(ctx context.Context, ref, dir string) error) cli.Command {
	return cli.Command{
		Name:  name,
		Usage: usage,
		Setup: func(fs *cli.FlagSet) func(context.Context) error {
			stateDir := fs.String("state-dir", "VM_MANAGER_STATE_DIR", statedir.Default(), "state directory")
			imageDir := fs.String("image-dir", "VM_MANAGER_IMAGE_DIR", "", imageHelp)
			run := setup(fs)
			return func(ctx context.Context) error {
				if len(ia.args) != 1 {
					return fmt.Errorf("want one <ref>, got %q", ia.args)
				}
				return run(ctx, ia.args[0], cmp.Or(*imageDir, filepath.Join(*stateDir, "images")))
			}
		},
	}
}
