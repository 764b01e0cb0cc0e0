package rest

import (
	"context"
	"net/http"
	"strings"

	"google.golang.org/protobuf/proto"
)

// warned is a response that can be partial: a fleet gateway's list, whose
// nodes that did not answer are warnings.
type warned interface{ GetWarnings() []string }

// setWarnings adds a Warning header (RFC 9111, code 199) per warning of a
// partial list: REST's list bodies are bare arrays (the contract's shape),
// so the header is where "partial" is said.
func setWarnings(_ context.Context, w http.ResponseWriter, m proto.Message) error {
	if p, ok := m.(warned); ok {
		for _, text := range p.GetWarnings() {
			w.Header().Add("Warning", WarningValue(text))
		}
	}
	return nil
}

// WarningValue is text as a Warning header's value.
func WarningValue(text string) string {
	text = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, text)
	return `199 vm-manager "` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(text) + `"`
}
