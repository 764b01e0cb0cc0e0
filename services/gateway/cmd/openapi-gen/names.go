package main

import (
	"fmt"
	"strings"
	"unicode"

	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// The original vm-manager named its schemas for what they hold ("VM",
// "Console") and its operations in lowerCamelCase ("getVM"); clients
// generated from its document use those names as type and method names. The
// document keeps them, and names our own additions the same way:
//
//   - a schema is its message's name without the package, "VirtualMachine"
//     shortened to "VM" (CreateVirtualMachineRequest is CreateVMRequest),
//     except where the original chose another name (schemaNames);
//   - an operation is its RPC's name in lowerCamelCase with the same
//     shortening (ListVirtualMachines is listVMs), except operationIDs.

// schemaNames are the messages the original named otherwise.
var schemaNames = map[protoreflect.FullName]string{
	"vmmanager.hypervisor.v1.VirtualMachineMetrics":             "Metrics",
	"vmmanager.hypervisor.v1.GetVirtualMachineConsoleResponse":  "Console",
	"vmmanager.hypervisor.v1.ExecVirtualMachineRequest":         "ExecRequest",
	"vmmanager.hypervisor.v1.ExecVirtualMachineResponse":        "ExecResult",
	"vmmanager.hypervisor.v1.ForwardVirtualMachinePortRequest":  "ForwardRequest",
	"vmmanager.hypervisor.v1.ForwardVirtualMachinePortResponse": "Forward",
	// Ours: "WatchVMsResponse" would be the type a generated client
	// (oapi-codegen) names the watchVMs operation's response.
	"vmmanager.hypervisor.v1.WatchVirtualMachinesResponse": "WatchEvent",
	// Likewise for importImage and forkVM.
	"vmmanager.hypervisor.v1.ImportImageResponse":        "ImportProgress",
	"vmmanager.hypervisor.v1.ForkVirtualMachineResponse": "Forks",
}

// operationIDs are the RPCs the original named otherwise.
var operationIDs = map[protoreflect.FullName]string{
	"vmmanager.hypervisor.v1.HypervisorService.ForwardVirtualMachinePort": "forwardPort",
}

// shorten is the original's abbreviation of "VirtualMachine".
var shorten = strings.NewReplacer("VirtualMachines", "VMs", "VirtualMachine", "VM")

func schemaName(full protoreflect.FullName) string {
	if n, ok := schemaNames[full]; ok {
		return n
	}
	return shorten.Replace(string(full.Name()))
}

func operationID(rpc protoreflect.MethodDescriptor) string {
	if id, ok := operationIDs[rpc.FullName()]; ok {
		return id
	}
	r := []rune(shorten.Replace(string(rpc.Name())))
	r[0] = unicode.ToLower(r[0])
	return string(r)
}

// errorCodes are the error codes each operation documents with its own
// status (contract §1.2); anything else, such as unauthenticated or
// unavailable, is the operation's default response. Every operation is
// listed, so a new RPC cannot be forgotten.
var errorCodes = map[protoreflect.Name][]apierr.Code{
	// HypervisorService.
	"GetHost":                   {apierr.Internal},
	"ListImages":                nil,
	"GetImage":                  {apierr.NotFound},
	"ImportImage":               {apierr.InvalidRequest, apierr.NotFound, apierr.Conflict, apierr.ResourceExhausted},
	"ListNetworks":              nil,
	"CreateNetwork":             {apierr.InvalidRequest, apierr.Conflict},
	"GetNetwork":                {apierr.NotFound},
	"DeleteNetwork":             {apierr.NotFound, apierr.Conflict},
	"ListVirtualMachines":       nil,
	"CreateVirtualMachine":      {apierr.InvalidRequest, apierr.Conflict, apierr.VMFailed, apierr.Timeout},
	"GetVirtualMachine":         {apierr.NotFound},
	"DeleteVirtualMachine":      {apierr.NotFound, apierr.Conflict},
	"StartVirtualMachine":       {apierr.NotFound, apierr.Conflict},
	"StopVirtualMachine":        {apierr.NotFound, apierr.Conflict},
	"RebootVirtualMachine":      {apierr.NotFound, apierr.Conflict},
	"ExecVirtualMachine":        {apierr.InvalidRequest, apierr.NotFound, apierr.Conflict},
	"ForwardVirtualMachinePort": {apierr.InvalidRequest, apierr.NotFound, apierr.Conflict},
	"GetVirtualMachineConsole":  {apierr.InvalidRequest, apierr.NotFound},
	"GetVirtualMachineMetrics":  {apierr.NotFound},
	"GetVirtualMachineReport":   {apierr.NotFound},
	// Lifetimes.
	"UpdateVirtualMachineLifetime": {apierr.InvalidRequest, apierr.NotFound, apierr.Conflict},
	"WatchVirtualMachines":         {apierr.InvalidRequest, apierr.NotFound, apierr.OutOfRange, apierr.ResourceExhausted},
	"SuspendVirtualMachine":        {apierr.NotFound, apierr.Conflict, apierr.VMFailed},
	"ResumeVirtualMachine":         {apierr.NotFound, apierr.Conflict, apierr.VMFailed},
	"ForkVirtualMachine":           {apierr.InvalidRequest, apierr.NotFound, apierr.Conflict, apierr.Unsupported, apierr.ResourceExhausted, apierr.VMFailed, apierr.Timeout},
	"CreatePool":                   {apierr.InvalidRequest, apierr.Conflict, apierr.ResourceExhausted},
	"ListPools":                    nil,
	"GetPool":                      {apierr.NotFound},
	"ResizePool":                   {apierr.InvalidRequest, apierr.NotFound, apierr.ResourceExhausted},
	"DeletePool":                   {apierr.NotFound},
	// AttestationService.
	"GetVirtualMachineAttestation": {apierr.NotFound},
	"ListImagePolicies":            nil,
	"GetImagePolicy":               {apierr.NotFound},
	"ImportImagePolicy":            {apierr.InvalidRequest},
	"RecordGolden":                 {apierr.InvalidRequest, apierr.NotFound, apierr.Conflict},
	"ClearGolden":                  {apierr.NotFound},
	"GetAttestationStatus":         nil,
}

// errorStatuses gives each operation a response per status its errorCodes
// map to, with the error envelope.
func errorStatuses(ops []operation) error {
	for _, o := range ops {
		codes, ok := errorCodes[o.rpc.Name()]
		if !ok {
			return fmt.Errorf("%s: %s has no entry in errorCodes", o, o.rpc.FullName())
		}
		byStatus := map[string][]string{}
		for _, c := range codes {
			s := fmt.Sprint(apierr.HTTPStatus(c))
			byStatus[s] = append(byStatus[s], string(c))
		}
		responses := asObj(o.op["responses"])
		for s, names := range byStatus {
			responses[s] = obj{
				"description": "The error envelope, code " + strings.Join(names, " or ") + ".",
				"content":     obj{"application/json": obj{"schema": obj{"$ref": schemaRef + errorSchema}}},
			}
		}
	}
	return nil
}
