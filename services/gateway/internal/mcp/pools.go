package mcp

// Warm pools (docs/mcp.md "Warm pools"): CreatePool, ListPools, GetPool,
// ResizePool and DeletePool, each one call (registered in toolDefs after
// import_image): their arguments and descriptions.

type (
	poolArgs struct {
		Name string `json:"name" jsonschema:"the pool name (list_pools lists them)"`
	}

	listPoolsArgs struct {
		Node string `json:"node,omitempty" jsonschema:"fleet gateway only: only this node's pools; default: every node's"`
	}

	// createPoolArgs is create_vm's shape, with its defaults: a create
	// claims a member when its shape, defaults filled in, is the pool's.
	createPoolArgs struct {
		Name               string `json:"name" jsonschema:"a DNS label of at most 63 characters, unique among pools"`
		Size               int32  `json:"size" jsonschema:"how many members to keep ready: 0 (the pool stays defined but empty) to the server's --max-pool-size" schema:"min=0"`
		Image              string `json:"image,omitempty" jsonschema:"as create_vm's: \"<id>_<version>\" or the bare id; default: the newest version of the newest image, resolved once when the pool is created"`
		KubernetesVersion  string `json:"kubernetes_version,omitempty" jsonschema:"as create_vm's: one of the image's kubernetesVersions; default: the newest it offers"`
		CPUs               *int32 `json:"cpus,omitempty" jsonschema:"virtual CPUs of each member, 1 to 256; 0 or absent: the default" schema:"min=1,max=256,default=@cpus,zero"`
		MemoryMiB          *int32 `json:"memory_mib,omitempty" jsonschema:"memory of each member in MiB, at least 256; 0 or absent: the default" schema:"min=256,default=@memoryMiB,zero"`
		DiskGiB            *int32 `json:"disk_gib,omitempty" jsonschema:"disk size of each member in GiB, 1 to 4096; 0 or absent: the default" schema:"min=1,max=4096,default=@diskGiB,zero"`
		Network            string `json:"network,omitempty" jsonschema:"the network the members attach to (default \"default\")"`
		RequireAttestation *bool  `json:"require_attestation,omitempty" jsonschema:"as create_vm's (default true): a create claims a member only with the same value" schema:"default=true"`
		Node               string `json:"node,omitempty" jsonschema:"fleet gateway only: the node to keep the pool on (get_host lists them); required unless the fleet has one node"`
	}

	resizePoolArgs struct {
		Name string `json:"name" jsonschema:"the pool name"`
		Size int32  `json:"size" jsonschema:"how many members to keep ready: 0 to the server's --max-pool-size; a shrink deletes the ready members beyond it" schema:"min=0"`
	}
)

const (
	listPoolsDescription = `Read-only. Warm pools, sorted by name. A pool keeps size VMs of one shape (image, kubernetesVersion, cpus, memoryMib, diskGib, network, requireAttestation) booted, attested and suspended; create_vm with that shape claims one (resumed in seconds) instead of booting. status has ready and filling (members being booted), hits, misses, refills, refillFailures and lastError. Behind a fleet gateway each pool names its node.`
	getPoolDescription   = `Read-only. One warm pool: its shape, size and status (ready and filling members, each member's VM id and state, hits, misses, refills, diskBytes, lastError: why the last refill failed).`

	createPoolDescription = `WRITES: create a warm pool: the server boots size VMs of this shape, attests each at the initrd stage and suspends it (no CPU or RAM used, its disk and saved state kept), and refills in the background as members are claimed. From then on create_vm claims a ready member automatically whenever its image, kubernetes_version, cpus, memory_mib, disk_gib, network and require_attestation (defaults filled in alike) equal the pool's: it resumes in seconds, gets create_vm's name, user_data and keys, and its fromPool names the pool; create_vm with skip_pool true boots a fresh VM instead. Returns the pool with its members filling: poll get_pool until status.ready reaches size. Behind a fleet gateway a pool is on one node (give node; required unless the fleet has one node), and create_vm claims from it only when it names that node: placement does not look at pools. Errors: conflict (the name is taken), resource_exhausted (size over --max-pool-size, or the host's bounds), invalid_request, not_found (no such image or network).`

	resizePoolDescription = `WRITES: change how many members a warm pool keeps ready (0 to --max-pool-size). Growing boots the new members in the background (poll get_pool); shrinking deletes the ready members beyond the size. VMs already claimed from the pool are not affected. Returns the pool. Errors: not_found, resource_exhausted, invalid_request.`

	deletePoolDescription = `WRITES (destructive): delete a warm pool and its unclaimed members (ready or filling). VMs already claimed from it are untouched and stay the callers'. Returns {name, deleted, membersDeleted}. not_found for an unknown pool.`
)
