package guestimage

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"syscall"
)

// resolveDir makes dir absolute and follows a symbolic link to it, so the
// swap replaces the directory rather than the link.
func resolveDir(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	real, err := filepath.EvalSymlinks(abs)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return abs, nil
	case err != nil:
		return "", err
	}
	fi, err := os.Stat(real)
	if err != nil {
		return "", err
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("%s: not a directory", dir)
	}
	return real, nil
}

// swap puts stage in dir's place. Normally two renames: dir aside, stage in,
// then the old tree is removed. When dir cannot be renamed (a mount point) its
// entries are removed and stage's moved in instead (not atomic, but every file
// has been verified by then).
func swap(stage, dir string, log *slog.Logger) error {
	fi, err := os.Stat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.Chmod(stage, 0o755); err != nil {
			return err
		}
		return os.Rename(stage, dir)
	}
	if err != nil {
		return err
	}
	if err := os.Chmod(stage, fi.Mode().Perm()); err != nil {
		return err
	}
	old := stage + ".old"
	if err := os.Rename(dir, old); err != nil {
		log.Info("cannot move the image directory aside; replacing its contents", "dir", dir, "err", err)
		return replaceContents(stage, dir)
	}
	if err := os.Rename(stage, dir); err != nil {
		if rerr := os.Rename(old, dir); rerr != nil {
			return fmt.Errorf("%w (and restoring the old directory from %s: %v)", err, old, rerr)
		}
		return err
	}
	if err := os.RemoveAll(old); err != nil {
		log.Warn("removing the previous image directory", "dir", old, "err", err)
	}
	return nil
}

func replaceContents(stage, dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	staged, err := os.ReadDir(stage)
	if err != nil {
		return err
	}
	// The marker goes last: a directory without it is pulled again.
	slices.SortStableFunc(staged, func(a, b os.DirEntry) int {
		return boolCmp(a.Name() == MarkerFile, b.Name() == MarkerFile)
	})
	for _, e := range staged {
		if err := move(filepath.Join(stage, e.Name()), filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

func boolCmp(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// move renames src to dst, copying across file systems.
func move(src, dst string) error {
	err := os.Rename(src, dst)
	if !errors.Is(err, syscall.EXDEV) {
		return err
	}
	fi, err := os.Stat(src)
	if err != nil {
		return err
	}
	if fi.IsDir() {
		err = os.CopyFS(dst, os.DirFS(src))
	} else {
		err = CopyFile(src, dst, fi.Mode().Perm())
	}
	if err != nil {
		return err
	}
	return os.RemoveAll(src)
}

// CopyFile copies the file src to dst, which must not exist yet.
func CopyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
