// Package defaults holds the sizes CreateVirtualMachine gives a VM when the
// request leaves one out (or, as the original does, asks for 0). The
// hypervisor applies them; the MCP tools' schemas show them; an SDK caller can
// read them. They live here, not in gen/, because gen/ is only what
// `make generate` writes.
package defaults

const (
	CPUs      = 2
	MemoryMiB = 2048
	DiskGiB   = 20
)
