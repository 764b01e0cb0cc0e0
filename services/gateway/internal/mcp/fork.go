package mcp

import hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"

// Forks (docs/mcp.md "Forks"): fork_vm, one ForkVirtualMachine call
// (registered in toolDefs after the pool tools).

// forkArgs are fork_vm's arguments. count's bound is the hypervisor's
// vm.MaxForks, which the gateway cannot import: the schema shows it so an
// agent does not learn it from an invalid_request.
type forkArgs struct {
	ID      string `json:"id" jsonschema:"the parent VM's id (8 hex characters): a ready or running VM without a disk"`
	Count   int32  `json:"count,omitempty" jsonschema:"how many forks to make, 1 to 16; 0 or absent: 1" schema:"min=1,max=16,default=1,zero"`
	WaitFor string `json:"wait_for,omitempty" jsonschema:"what to block for: none (the forks were started) or ready (the default, also for \"\": each fork took its new identity and its quote verified)" schema:"enum=none|ready,default=\"ready\",zero"`
}

func forkRequest(in *forkArgs) *hypervisorv1.ForkVirtualMachineRequest {
	// The schema's enum leaves only none, ready and "".
	return &hypervisorv1.ForkVirtualMachineRequest{Id: in.ID, Count: in.Count, WaitFor: waitFor[in.WaitFor]}
}

const forkVMDescription = `WRITES: fork a ready or running VM into count new VMs (1 to 16, default 1) that carry on from a snapshot of its memory, devices and disk: the guest's processes, files and state as they were, with no boot or install. Disks are copy-on-write: each fork writes its own, and neither the parent nor another fork sees what it writes after the fork. Each fork is a VM of its own: its own id, name (<parent name>-fork-<its id>), MAC and IP address, and its own vTPM with a fresh EK and AK, the parent's verified measurements replayed into its PCRs; it is registered with attestation as a fork of the parent, so get_vm_attestation on a fork names the parent in forkedFrom (as get_vm's forkedFrom does) and its quotes verify with the fork's own key only. The parent keeps running: it is paused only while its snapshot is taken (the result's pauseSeconds). Blocks per wait_for: ready (the default) or none. Returns {vms, pauseSeconds}. Errors: conflict (the parent is not ready or running, or has no verified quote yet: get_vm_attestation shows when it has), not_found, resource_exhausted (the host's --max-vms), invalid_request (count), vm_failed, timeout; forks made before an error stay (list_vms, forkedFrom): delete_vm them if unwanted. Behind a fleet gateway the forks are made on the parent's node.`
