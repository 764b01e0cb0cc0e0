// Package imdswire is the JSON the guest and the IMDS exchange at
// POST /giantswarm/v1/attest/quote (contract §5.2): one definition for
// vm-agent, which sends it, and the hypervisor's IMDS, which reads it.
package imdswire

// QuoteRequest is a TPM quote for one boot stage. PCRs are
// {"sha256": {"<index>": "<hex>"}}; byte fields are base64 in JSON.
type QuoteRequest struct {
	Stage        string                       `json:"stage"` // initrd or ready
	Nonce        string                       `json:"nonce"` // the 64 hex characters of attest/nonce
	AKPub        []byte                       `json:"ak_pub"`
	EKPub        []byte                       `json:"ek_pub,omitempty"`
	Quote        []byte                       `json:"quote"`
	Signature    []byte                       `json:"signature"`
	PCRs         map[string]map[string]string `json:"pcrs"`
	EventLog     []byte                       `json:"event_log,omitempty"`
	UserspaceLog []byte                       `json:"userspace_log,omitempty"`
}

// QuoteResponse is the IMDS's answer to a quote, whatever the status.
type QuoteResponse struct {
	Stage            string `json:"stage"`
	Verified         bool   `json:"verified"`
	UserDataReleased bool   `json:"user_data_released"`
	Message          string `json:"message,omitempty"`
}
