package hypervisorv1

// What CreateVirtualMachine gives a VM when the request leaves a size out
// (or, as the original does, asks for 0). Written by hand: `make generate`
// keeps it. The hypervisor applies them; the MCP tools' schemas show them.
const (
	DefaultCPUs      = 2
	DefaultMemoryMiB = 2048
	DefaultDiskGiB   = 20
)
