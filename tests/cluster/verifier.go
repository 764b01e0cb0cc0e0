package cluster

import (
	"context"
	"io/fs"
	"path/filepath"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/mesh"
)

// Sockets lists the unix sockets below each of dirs.
func Sockets(dirs ...string) []string {
	var out []string
	for _, dir := range dirs {
		_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.Type()&fs.ModeSocket != 0 {
				out = append(out, p)
			}
			return nil
		})
	}
	return out
}

// ReachesVerifier says whether attestation's VerifierService answers on
// socket, with a call that changes nothing (forgetting a VM that does not
// exist). Whoever it answers can register boots and keys without any
// identity: only the hypervisor may.
func ReachesVerifier(socket string) bool {
	conn, err := mesh.Dial(socket)
	if err != nil {
		return false
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = attestationv1.NewVerifierServiceClient(conn).ForgetVirtualMachine(ctx, &attestationv1.ForgetVirtualMachineRequest{VmId: "ffffffff"})
	return err == nil
}
