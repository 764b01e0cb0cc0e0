// Package openapi embeds the OpenAPI 3.1 document of vm-manager's REST API,
// generated from the protos by `make generate` (services/gateway/cmd/openapi-gen).
package openapi

import _ "embed"

// JSON is the document as JSON.
//
//go:embed vmmanager.openapi.json
var JSON []byte

// YAML is the same document as YAML.
//
//go:embed vmmanager.openapi.yaml
var YAML []byte
