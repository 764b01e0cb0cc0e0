package guestapi

import (
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/catalog"
)

// SysupdateFile opens <component>/<file> of the VM's image's sysupdate tree
// (its own <stem>.sysupdate/, else <image-dir>/sysupdate/): one level, a
// regular file, nothing that climbs out, by name or by symlink (os.Root: a
// link inside the tree may point elsewhere inside it, never outside).
func (s *Side) SysupdateFile(vmID, component, file string) (io.ReadSeekCloser, int64, error) {
	for _, part := range []string{component, file} {
		if part == "" || part == "." || part == ".." || strings.ContainsAny(part, "/\\\x00") {
			return nil, 0, apierr.Errorf(apierr.NotFound, "no such sysupdate file")
		}
	}
	if s.cfg.ImageDir == "" {
		return nil, 0, apierr.Errorf(apierr.NotFound, "no image directory")
	}
	rec, err := s.records.Record(vmID)
	if err != nil {
		return nil, 0, err
	}
	root, err := os.OpenRoot(catalog.SysupdateDir(s.cfg.ImageDir, rec.GetImage()))
	if err != nil {
		return nil, 0, apierr.Errorf(apierr.NotFound, "no such sysupdate file")
	}
	defer root.Close()
	f, err := root.Open(filepath.Join(component, file))
	if err != nil {
		return nil, 0, apierr.Errorf(apierr.NotFound, "no such sysupdate file")
	}
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, 0, apierr.Errorf(apierr.NotFound, "no such sysupdate file")
	}
	return f, fi.Size(), nil
}
