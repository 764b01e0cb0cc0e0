package ocirun

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// maxLinks bounds symlinks followed in one resolution (the kernel's 40).
const maxLinks = 40

// ResolveIn returns the path under root that name (absolute inside the
// image) reaches as the kernel would after chroot(root): symlinks are
// followed, absolute ones restart at root, and ".." stops there. Parts that
// do not exist are kept as written. vm-agent mounts on and reads through
// such paths outside the chroot, where an image's (or an earlier workload's
// upper-directory) symlink must not lead out of the root.
func ResolveIn(root, name string) (string, error) {
	var done string // resolved so far, relative to root, symlink-free
	rest := name
	links := 0
	for rest != "" {
		var comp string
		comp, rest, _ = strings.Cut(strings.TrimLeft(rest, "/"), "/")
		switch comp {
		case "", ".":
			continue
		case "..":
			done = parent(done)
			continue
		}
		next := path.Join(done, comp)
		fi, err := os.Lstat(filepath.Join(root, next))
		if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
			done = next // a missing part: what follows is lexical
			continue
		}
		if links++; links > maxLinks {
			return "", fmt.Errorf("%s: too many levels of symbolic links", name)
		}
		target, err := os.Readlink(filepath.Join(root, next))
		if err != nil {
			return "", err
		}
		if strings.HasPrefix(target, "/") {
			done = ""
		}
		rest = target + "/" + rest
	}
	return filepath.Join(root, done), nil
}

func parent(p string) string {
	if d := path.Dir(p); d != "." {
		return d
	}
	return ""
}

// readFileIn reads a file of the image, at most max bytes of it.
func readFileIn(root, name string, max int64) ([]byte, error) {
	p, err := ResolveIn(root, name)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("%s: larger than %d bytes", name, max)
	}
	return b, nil
}

// lookPath finds an executable as execvp does inside the image: a name with
// a slash as it is, else the first regular file with an execute bit in the
// image's PATH. The result is a path inside the root.
func lookPath(root, name, pathEnv, dir string) (string, error) {
	if name == "" {
		return "", errors.New("empty command name")
	}
	if strings.Contains(name, "/") {
		abs := name
		if !path.IsAbs(abs) {
			abs = path.Join(dir, abs)
		}
		if err := executableIn(root, abs); err != nil {
			return "", err
		}
		return name, nil
	}
	for _, d := range filepath.SplitList(pathEnv) {
		if d == "" {
			d = "."
		}
		if !path.IsAbs(d) {
			d = path.Join(dir, d)
		}
		p := path.Join(d, name)
		if executableIn(root, p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("executable file %q not found in the image's PATH (%s)", name, pathEnv)
}

func executableIn(root, name string) error {
	p, err := ResolveIn(root, name)
	if err != nil {
		return err
	}
	fi, err := os.Stat(p)
	if err != nil {
		return fmt.Errorf("%s: not in the image", name)
	}
	if !fi.Mode().IsRegular() || fi.Mode()&0o111 == 0 {
		return fmt.Errorf("%s: not an executable file", name)
	}
	return nil
}
