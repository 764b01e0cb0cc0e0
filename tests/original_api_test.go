package tests

// The original vm-manager's REST surface, as its clients see it: what
// TestOpenAPIMatchesOriginal holds the served document against. Written by
// us from the contract (docs/contract.md §1) and from reading the original's
// OpenAPI document; it is a description, not a copy of that file.
//
// Property types are written in a small notation:
//
//	string, integer, boolean, number, object   the JSON type
//	integer/int64, string/date-time            with its format
//	string:a|b|c                                an enum with these values
//	[]T                                         an array of T
//	#Name                                       the named schema Name
//	.Name                                       an object described inline,
//	                                            given below as Schema.property
//	T?                                          T or null
//	any                                         any JSON value

// origOp is one operation: path below the /api/v1 server.
type origOp struct {
	method, path, id string
	params           []string // "in:name" of each parameter, "!" suffix when required
	body             string   // request body schema, "#Name"
	status           int      // the success status
	result           string   // the success body: "#Name", "[]#Name", a type, or "" for none
	errors           []int    // error statuses answered with the #Error envelope
}

var originalServer = "/api/v1"

var originalOps = []origOp{
	{"GET", "/host", "getHost", nil, "", 200, "#Host", []int{500}},
	{"GET", "/images", "listImages", nil, "", 200, "[]#Image", nil},
	{"GET", "/images/{ref}", "getImage", []string{"path:ref!"}, "", 200, "#Image", []int{404}},
	{"GET", "/networks", "listNetworks", nil, "", 200, "[]#Network", nil},
	{"POST", "/networks", "createNetwork", nil, "#CreateNetworkRequest", 201, "#Network", []int{400, 409}},
	{"GET", "/networks/{name}", "getNetwork", []string{"path:name!"}, "", 200, "#Network", []int{404}},
	{"DELETE", "/networks/{name}", "deleteNetwork", []string{"path:name!"}, "", 204, "", []int{404, 409}},
	{"GET", "/vms", "listVMs", nil, "", 200, "[]#VM", nil},
	{"POST", "/vms", "createVM", nil, "#CreateVMRequest", 201, "#VM", []int{400, 500, 504}},
	{"GET", "/vms/{id}", "getVM", []string{"path:id!"}, "", 200, "#VM", []int{404}},
	{"DELETE", "/vms/{id}", "deleteVM", []string{"path:id!"}, "", 204, "", []int{404, 409}},
	{"POST", "/vms/{id}/start", "startVM", []string{"path:id!"}, "", 200, "#VM", []int{404, 409}},
	{"POST", "/vms/{id}/stop", "stopVM", []string{"path:id!"}, "", 200, "#VM", []int{404, 409}},
	{"POST", "/vms/{id}/reboot", "rebootVM", []string{"path:id!"}, "", 200, "#VM", []int{404, 409}},
	{"POST", "/vms/{id}/exec", "execVM", []string{"path:id!"}, "#ExecRequest", 200, "#ExecResult", []int{400, 404, 409}},
	{"POST", "/vms/{id}/forward", "forwardPort", []string{"path:id!"}, "#ForwardRequest", 200, "#Forward", []int{400, 404, 409}},
	{"GET", "/vms/{id}/console", "getVMConsole", []string{"path:id!", "query:lines"}, "", 200, "#Console", []int{400, 404}},
	{"GET", "/vms/{id}/attestation", "getVMAttestation", []string{"path:id!"}, "", 200, "#Attestation", []int{404}},
	{"GET", "/vms/{id}/metrics", "getVMMetrics", []string{"path:id!"}, "", 200, "#Metrics", []int{404}},
	{"GET", "/vms/{id}/report", "getVMReport", []string{"path:id!"}, "", 200, "object", []int{404}},
	{"GET", "/openapi.yaml", "getOpenAPI", nil, "", 200, "string", nil},
}

// origParamTypes are the non-string parameters.
var origParamTypes = map[string]string{"getVMConsole query:lines": "integer"}

// origSchema is one schema: its required keys and its properties' types.
type origSchema struct {
	required []string
	props    map[string]string
}

var originalSchemas = map[string]origSchema{
	"Host": {
		[]string{"hostname", "kernel", "cpus", "memoryBytes", "kvm", "vhostVsock", "qemu", "swtpm", "systemd", "storageProviders", "ready"},
		map[string]string{
			"hostname": "string", "kernel": "string", "cpus": "integer", "memoryBytes": "integer/int64",
			"kvm": "#Device", "vhostVsock": "#Device", "qemu": "#Tool", "swtpm": "#Tool", "systemd": "#Tool",
			"ovmfCode": "string", "storageProviders": "[]string", "ready": "boolean", "missing": "[]string",
		},
	},
	"Device": {[]string{"path", "accessible"}, map[string]string{"path": "string", "accessible": "boolean", "error": "string"}},
	"Tool":   {[]string{"found"}, map[string]string{"found": "boolean", "version": "string", "error": "string"}},
	"Image": {
		[]string{"id", "version", "uki", "disk"},
		map[string]string{
			"id": "string", "version": "string", "uki": "string", "disk": "string", "sysupdateDir": "string",
			"kubernetesVersions": "[]string", "policy": "object",
		},
	},
	"CreateNetworkRequest": {[]string{"name", "cidr"}, map[string]string{"name": "string", "cidr": "string", "dns_search_domain": "string"}},
	"NetworkSpec": {
		[]string{"name", "cidr", "enableIMDS"},
		map[string]string{
			"name": "string", "cidr": "string", "gatewayIP": "string", "dnsSearchDomain": "string",
			"enableIMDS": "boolean", "enableHostAlias": "boolean",
		},
	},
	"Lease":   {[]string{"vmID", "mac", "ip"}, map[string]string{"vmID": "string", "mac": "string", "ip": "string"}},
	"Network": {[]string{"spec", "gateway", "leases"}, map[string]string{"spec": "#NetworkSpec", "gateway": "string", "leases": "[]#Lease"}},
	"CreateVMRequest": {
		[]string{"name"},
		map[string]string{
			"name": "string", "image": "string", "kubernetes_version": "string", "cpus": "integer", "memory_mib": "integer",
			"disk_gib": "integer", "network": "string", "user_data": "string", "ssh_authorized_keys": "[]string",
			"hostname": "string", "metadata": "object", "require_attestation": "boolean",
			"wait_for": "string:none|installed|attested|ready",
		},
	},
	"Quote": {[]string{"verified", "at"}, map[string]string{"verified": "boolean", "message": "string", "at": "string/date-time"}},
	"Attestation": {
		[]string{"required", "userDataReleased"},
		map[string]string{
			"required": "boolean", "userDataReleased": "boolean", "nonceIssuedAt": "string/date-time",
			"initrd": "#Quote", "ready": "#Quote",
		},
	},
	"Paths": {nil, map[string]string{
		"dir": "string", "volume": "string", "console": "string", "tpmState": "string", "ovmfVars": "string",
		"qmpSocket": "string", "sshKey": "string", "userData": "string", "report": "string",
	}},
	"VM": {
		[]string{"id", "name", "image", "cpus", "memoryMiB", "diskGiB", "network", "requireAttestation", "state", "cid", "machineID", "booted", "sshPublicKey", "attestation", "createdAt", "paths"},
		map[string]string{
			"id": "string", "name": "string", "image": "string", "kubernetesVersion": "string",
			"cpus": "integer", "memoryMiB": "integer", "diskGiB": "integer", "network": "string",
			"sshAuthorizedKeys": "[]string", "hostname": "string", "metadata": "object", "region": "string", "zone": "string",
			"requireAttestation": "boolean",
			"state":              "string:creating|installing|booting|attesting|ready|running|stopping|stopped|failed|deleting",
			"phase":              "string:install|boot",
			"ip":                 "string", "mac": "string", "cid": "integer", "machineID": "string", "booted": "boolean",
			"status": "string", "sshPublicKey": "string", "attestation": "#Attestation",
			"createdAt": "string/date-time", "installedAt": "string/date-time", "bootedAt": "string/date-time", "readyAt": "string/date-time",
			"lastError": "string", "paths": "#Paths",
		},
	},
	"ExecRequest":    {[]string{"command"}, map[string]string{"command": "[]string"}},
	"ExecResult":     {[]string{"stdout", "stderr", "exitCode"}, map[string]string{"stdout": "string", "stderr": "string", "exitCode": "integer"}},
	"ForwardRequest": {[]string{"port"}, map[string]string{"port": "integer"}},
	"Forward":        {[]string{"id", "port", "address"}, map[string]string{"id": "string", "port": "integer", "address": "string"}},
	"Console":        {[]string{"id", "lines", "console"}, map[string]string{"id": "string", "lines": "integer", "console": "string"}},
	"Metrics": {
		[]string{"id", "host", "guest"},
		map[string]string{"id": "string", "host": ".host", "guest": ".guest?", "raw_report_url": "string", "note": "string"},
	},
	"Metrics.host": {
		[]string{"state", "attestation", "disk_bytes", "network"},
		map[string]string{
			"state": "string", "attestation": "string:disabled|pending|released|failed", "pid": "integer",
			"cpu_seconds": "number", "memory_rss_bytes": "integer", "disk_bytes": "integer",
			"install_seconds": "number", "boot_to_ready_seconds": "number", "network": ".network",
		},
	},
	"Metrics.host.network": {
		[]string{"name", "bytes_sent", "bytes_received", "leases"},
		map[string]string{"name": "string", "bytes_sent": "integer", "bytes_received": "integer", "leases": "integer"},
	},
	"Metrics.guest": {
		[]string{"received_at", "report_age_seconds", "families", "series", "series_exported", "series_dropped", "sample"},
		map[string]string{
			"received_at": "string/date-time", "generated_at": "string/date-time", "report_age_seconds": "number",
			"families": "integer", "series": "integer", "series_exported": "integer", "series_dropped": "integer",
			"sample": "[].sample",
		},
	},
	"Metrics.guest.sample": {[]string{"name", "value"}, map[string]string{"name": "string", "object": "string", "fields": "object", "value": "any"}},
	"Error":                {[]string{"error"}, map[string]string{"error": ".error"}},
	"Error.error": {
		[]string{"code", "message"},
		map[string]string{"code": "string:not_found|invalid_request|conflict|unsupported|timeout|vm_failed|internal_error", "message": "string"},
	},
}
