// Package enumname gives vm-manager's proto enum values the short names the
// REST API, MCP and the metrics use: the value name without the enum's
// prefix, lower-cased. STATE_READY (of State) is "ready", WAIT_FOR_ATTESTED
// (of WaitFor) is "attested", ATTESTATION_STATE_RELEASED (of
// AttestationState) is "released". The prefix is the enum's name in
// UPPER_SNAKE form plus "_", the buf lint convention every enum here follows.
package enumname

import (
	"slices"
	"strconv"
	"strings"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// Of is the short name of an enum value. A number the enum does not define
// is its decimal number, as the generated String method has it.
func Of(e protoreflect.Enum) string {
	v := e.Descriptor().Values().ByNumber(e.Number())
	if v == nil {
		return strconv.Itoa(int(e.Number()))
	}
	return Value(v)
}

// Value is the short name of an enum value descriptor.
func Value(v protoreflect.EnumValueDescriptor) string {
	prefix := Prefix(v.Parent().(protoreflect.EnumDescriptor))
	return strings.ToLower(strings.TrimPrefix(string(v.Name()), prefix))
}

// Prefix is the prefix of an enum's value names: "ATTESTATION_STATE_" for
// AttestationState.
func Prefix(e protoreflect.EnumDescriptor) string {
	var b strings.Builder
	for i, r := range string(e.Name()) {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return strings.ToUpper(b.String()) + "_"
}

// Names lists the short names of an enum's values in number order, leaving
// out the zero (_UNSPECIFIED) value; an alias of a number is not repeated.
func Names(e protoreflect.EnumDescriptor) []string {
	values := e.Values()
	nums := make([]protoreflect.EnumNumber, 0, values.Len())
	for i := range values.Len() {
		if n := values.Get(i).Number(); n != 0 && !slices.Contains(nums, n) {
			nums = append(nums, n)
		}
	}
	slices.Sort(nums)
	out := make([]string, len(nums))
	for i, n := range nums {
		out[i] = Value(values.ByNumber(n))
	}
	return out
}
