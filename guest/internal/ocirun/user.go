package ocirun

import (
	"bufio"
	"bytes"
	"fmt"
	"strconv"
	"strings"
)

// maxDBBytes bounds the image's /etc/passwd and /etc/group as read.
const maxDBBytes = 4 << 20

// User is who the image's processes run as.
type User struct {
	UID, GID uint32
	Groups   []uint32 // supplementary, from the image's /etc/group
	Home     string   // from /etc/passwd; "/" when the user has no entry
}

// dbEntry is one line of /etc/passwd (name, uid, gid, home) or /etc/group
// (name, gid, members).
type dbEntry struct {
	name    string
	id, gid uint32
	home    string
	members []string
}

// parseDB reads passwd (fields name:pw:uid:gid:gecos:home:shell) or group
// (name:pw:gid:members) lines; malformed ones are skipped, as libc does.
func parseDB(b []byte, group bool) []dbEntry {
	var out []dbEntry
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 64<<10), maxDBBytes)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Split(line, ":")
		if group && len(f) >= 3 {
			id, err := strconv.ParseUint(f[2], 10, 32)
			if err != nil {
				continue
			}
			e := dbEntry{name: f[0], id: uint32(id)}
			if len(f) >= 4 && f[3] != "" {
				e.members = strings.Split(f[3], ",")
			}
			out = append(out, e)
		} else if !group && len(f) >= 6 {
			uid, err1 := strconv.ParseUint(f[2], 10, 32)
			gid, err2 := strconv.ParseUint(f[3], 10, 32)
			if err1 != nil || err2 != nil {
				continue
			}
			out = append(out, dbEntry{name: f[0], id: uint32(uid), gid: uint32(gid), home: f[5]})
		}
	}
	return out
}

// ResolveUser resolves an OCI config's user ("", "uid", "uid:gid", "name",
// "name:group", "uid:group", "name:gid") against the image's passwd and
// group files, as container runtimes do: a name must exist, a number need
// not (its group is then 0 and its home "/"); a named user gets the groups
// that list it as a member.
func ResolveUser(spec string, passwd, group []byte) (User, error) {
	u := User{Home: "/"}
	if spec == "" {
		spec = "0"
	}
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")
	if userPart == "" || (hasGroup && groupPart == "") {
		return u, fmt.Errorf("user %q: empty user or group", spec)
	}
	users, groups := parseDB(passwd, false), parseDB(group, true)
	var name string
	if id, err := strconv.ParseUint(userPart, 10, 32); err == nil {
		u.UID = uint32(id)
		for _, e := range users {
			if e.id == u.UID {
				name, u.GID, u.Home = e.name, e.gid, e.home
				break
			}
		}
	} else {
		found := false
		for _, e := range users {
			if e.name == userPart {
				name, u.UID, u.GID, u.Home, found = e.name, e.id, e.gid, e.home, true
				break
			}
		}
		if !found {
			return u, fmt.Errorf("user %q: no such user in the image's /etc/passwd", userPart)
		}
	}
	if hasGroup {
		if id, err := strconv.ParseUint(groupPart, 10, 32); err == nil {
			u.GID = uint32(id)
		} else {
			found := false
			for _, e := range groups {
				if e.name == groupPart {
					u.GID, found = e.id, true
					break
				}
			}
			if !found {
				return u, fmt.Errorf("group %q: no such group in the image's /etc/group", groupPart)
			}
		}
	}
	if u.Home == "" {
		u.Home = "/"
	}
	// Supplementary groups: those listing the user's name, as runc's
	// GetExecUser has them, also when a group was given.
	if name != "" {
		seen := map[uint32]bool{u.GID: true}
		for _, e := range groups {
			for _, m := range e.members {
				if m == name && !seen[e.id] {
					seen[e.id] = true
					u.Groups = append(u.Groups, e.id)
				}
			}
		}
	}
	return u, nil
}
