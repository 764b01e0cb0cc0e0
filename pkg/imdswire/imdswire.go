// Package imdswire is the JSON the guest sends the IMDS (contract §5.2): the
// quote at POST /giantswarm/v1/attest/quote and the report at POST
// /giantswarm/v1/report. One definition for vm-agent, which sends them, and
// the hypervisor, which reads them.
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

// ReportMediaType is Report's mediaType.
const ReportMediaType = "application/vnd.io.systemd.report"

// Report is the body of POST /giantswarm/v1/report (contract §5.2): the
// upload of `systemd-report upload`, and of vm-agent, which adds Describe.
type Report struct {
	MediaType string         `json:"mediaType"`
	ReportID  string         `json:"reportID"`
	Timestamp string         `json:"timestamp"` // RFC 3339, or systemd's "Mon 2006-01-02 15:04:05 UTC"
	Metrics   []ReportMetric `json:"metrics"`
	// Describe is optional: the families as io.systemd.Metrics.Describe
	// (`systemd-report describe-metrics -j`) gives them. A family it does not
	// describe is a gauge, or a string family when its value is a string.
	Describe []ReportFamily `json:"describe,omitempty"`
}

// ReportMetric is one entry: Value is a number, a string or a boolean;
// Fields are further labels (strings; other JSON values are re-encoded).
type ReportMetric struct {
	Name   string         `json:"name"`
	Object string         `json:"object,omitempty"`
	Fields map[string]any `json:"fields,omitempty"`
	Value  any            `json:"value"`
}

// ReportFamily describes one metric family.
type ReportFamily struct {
	Name        string `json:"name"`
	Description string `json:"description,omitempty"`
	Type        string `json:"type"` // FamilyCounter, FamilyGauge or FamilyString
}

// Family types of ReportFamily.Type (io.systemd.Metrics' MetricFamilyType).
const (
	FamilyCounter = "counter"
	FamilyGauge   = "gauge"
	FamilyString  = "string"
)
