package mcp

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/google/jsonschema-go/jsonschema"

	"github.com/giantswarm/vm-manager/sdk/defaults"
)

// namedDefaults are defaults the hypervisor applies too: one definition, in
// the SDK, for both.
var namedDefaults = map[string]any{
	"cpus":      defaults.CPUs,
	"memoryMiB": defaults.MemoryMiB,
	"diskGiB":   defaults.DiskGiB,
}

// argSchema is a tool's input schema with what decodeArgs needs besides it.
type argSchema struct {
	schema   *jsonschema.Schema
	resolved *jsonschema.Resolved
	// zero are the properties whose zero value (0, "") means "the
	// default", as in the original: such a value is taken as absent.
	zero map[string]bool
}

// inputSchema derives the JSON schema of a tool's arguments from its Go input
// struct, the way the go-sdk does (jsonschema.For: the json name is the
// property, a field without omitempty is required, the `jsonschema` tag is
// the description), and then applies the constraints jsonschema-go has no tag
// for, from a `schema` tag of comma-separated key=value pairs:
//
//	min=N, max=N     minimum / maximum (numbers)
//	minItems=N       minItems (arrays)
//	default=JSON     default value, as JSON (applied before validation);
//	                 default=@name takes namedDefaults[name] (the SDK's)
//	enum=a|b|c       string enum
//	zero             0 or "" means the default: the schema accepts it
//	                 (an integer's bounds become anyOf [0, the bounds], a
//	                 string enum gains "")
//
// Pointer fields (optional scalars whose absence matters) get the plain type
// instead of jsonschema-go's ["null", T]; decodeArgs takes a null as absent.
func inputSchema[In any]() (*argSchema, error) {
	s, err := jsonschema.For[In](nil)
	if err != nil {
		return nil, err
	}
	// Undeclared arguments are ignored, not refused (decodeArgs): the schema
	// says so by allowing them, where jsonschema.For would not.
	s.AdditionalProperties = nil
	a := &argSchema{schema: s, zero: map[string]bool{}}
	t := reflect.TypeFor[In]()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		ps := s.Properties[name]
		if ps == nil {
			return nil, fmt.Errorf("%s: no schema for property %q", t, name)
		}
		if len(ps.Types) == 2 && ps.Types[0] == "null" {
			ps.Type, ps.Types = ps.Types[1], nil
		}
		tag, ok := f.Tag.Lookup("schema")
		if !ok {
			continue
		}
		for _, kv := range strings.Split(tag, ",") {
			if kv == "zero" {
				a.zero[name] = true
				continue
			}
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return nil, fmt.Errorf("%s.%s: bad schema tag %q", t, f.Name, kv)
			}
			switch k {
			case "min", "max":
				n, err := strconv.ParseFloat(v, 64)
				if err != nil {
					return nil, fmt.Errorf("%s.%s: %s: %w", t, f.Name, k, err)
				}
				if k == "min" {
					ps.Minimum = &n
				} else {
					ps.Maximum = &n
				}
			case "minItems":
				n, err := strconv.Atoi(v)
				if err != nil {
					return nil, fmt.Errorf("%s.%s: %s: %w", t, f.Name, k, err)
				}
				ps.MinItems = &n
			case "default":
				if name, ok := strings.CutPrefix(v, "@"); ok {
					d, known := namedDefaults[name]
					if !known {
						return nil, fmt.Errorf("%s.%s: no default named %q", t, f.Name, name)
					}
					b, _ := json.Marshal(d)
					v = string(b)
				}
				if !json.Valid([]byte(v)) {
					return nil, fmt.Errorf("%s.%s: default %q is not JSON", t, f.Name, v)
				}
				ps.Default = json.RawMessage(v)
			case "enum":
				for _, e := range strings.Split(v, "|") {
					ps.Enum = append(ps.Enum, e)
				}
			default:
				return nil, fmt.Errorf("%s.%s: unknown schema key %q", t, f.Name, k)
			}
		}
		if a.zero[name] {
			if err := acceptZero(ps); err != nil {
				return nil, fmt.Errorf("%s.%s: %w", t, f.Name, err)
			}
		}
	}
	a.resolved, err = s.Resolve(&jsonschema.ResolveOptions{ValidateDefaults: true})
	if err != nil {
		return nil, err
	}
	return a, nil
}

// acceptZero widens a property's schema to take its zero value too.
func acceptZero(ps *jsonschema.Schema) error {
	switch ps.Type {
	case "integer":
		var zero any = 0
		ps.AnyOf = []*jsonschema.Schema{{Const: &zero}, {Minimum: ps.Minimum, Maximum: ps.Maximum}}
		ps.Minimum, ps.Maximum = nil, nil
	case "string":
		if len(ps.Enum) > 0 {
			ps.Enum = append(ps.Enum, "")
		}
	default:
		return fmt.Errorf("zero on a %s", ps.Type)
	}
	return nil
}

// bounds are an integer property's minimum and maximum, also when
// acceptZero moved them into anyOf.
func bounds(s *jsonschema.Schema) (lo, hi *float64) {
	if len(s.AnyOf) == 2 && s.AnyOf[0].Const != nil {
		return s.AnyOf[1].Minimum, s.AnyOf[1].Maximum
	}
	return s.Minimum, s.Maximum
}

// decodeArgs decodes raw tool arguments into in, as leniently as the
// original: arguments the tool does not declare are ignored (and returned),
// a null is an absent argument, an integer may be given as a string ("22"),
// and 0 or "" where it means the default (argSchema.zero) is the default.
// The schema's defaults fill what is absent; then the arguments are
// validated. Every failure is the caller's fault.
func decodeArgs(raw json.RawMessage, a *argSchema, in any) (ignored []string, err error) {
	// Undeclared arguments stay raw: a body full of them is scanned once,
	// never built into values.
	var top map[string]json.RawMessage
	if t := bytes.TrimSpace(raw); len(t) > 0 && !bytes.Equal(t, []byte("null")) {
		// encoding/json would turn invalid UTF-8 into U+FFFD without a word,
		// as REST refuses it (restjson).
		if !utf8.Valid(t) {
			return nil, fmt.Errorf("arguments: invalid UTF-8 in the JSON text")
		}
		if t[0] != '{' {
			return nil, fmt.Errorf("arguments: want a JSON object")
		}
		if err := json.Unmarshal(t, &top); err != nil {
			return nil, fmt.Errorf("arguments: %v", err)
		}
	}
	args := map[string]any{}
	for name, rv := range top {
		ps, declared := a.schema.Properties[name]
		if !declared {
			ignored = append(ignored, name)
			continue
		}
		var v any
		if err := json.Unmarshal(rv, &v); err != nil {
			return nil, fmt.Errorf("argument %q: %v", name, err)
		}
		if v == nil {
			continue // null: absent
		}
		v = coerce(ps, v)
		if a.zero[name] && isZero(ps, v) {
			continue // the default's other name
		}
		args[name] = v
	}
	slices.Sort(ignored)
	if err := a.resolved.ApplyDefaults(&args); err != nil {
		return ignored, fmt.Errorf("arguments: %v", err)
	}
	if err := checkArgs(a.schema, args); err != nil {
		return ignored, err
	}
	// The schema validator is the safety net for anything checkArgs does not
	// cover; its messages are less readable.
	if err := a.resolved.Validate(args); err != nil {
		return ignored, fmt.Errorf("arguments: %s", cleanValidationError(err))
	}
	b, err := json.Marshal(args)
	if err != nil {
		return ignored, fmt.Errorf("arguments: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields() // nested objects (egress rules) stay strict
	if err := dec.Decode(in); err != nil {
		return ignored, fmt.Errorf("arguments: %v", err)
	}
	return ignored, nil
}

// typeOf is a schema's type; for jsonschema-go's ["null", T] of a nested
// slice or pointer, T.
func typeOf(s *jsonschema.Schema) string {
	if s.Type != "" {
		return s.Type
	}
	for _, t := range s.Types {
		if t != "null" {
			return t
		}
	}
	return ""
}

// isZero reports whether v is the zero value of the property's type.
func isZero(s *jsonschema.Schema, v any) bool {
	switch s.Type {
	case "integer":
		return v == float64(0)
	case "string":
		return v == ""
	}
	return false
}

// coerce turns integers given as strings ("22", as the original's
// mcp-go took them) into numbers, in v and what it contains; anything else
// is left for validation.
func coerce(s *jsonschema.Schema, v any) any {
	switch typeOf(s) {
	case "integer":
		if str, ok := v.(string); ok {
			if n, err := strconv.ParseInt(str, 10, 64); err == nil {
				return float64(n)
			}
		}
	case "array":
		if l, ok := v.([]any); ok && s.Items != nil {
			for i := range l {
				l[i] = coerce(s.Items, l[i])
			}
		}
	case "object":
		if m, ok := v.(map[string]any); ok {
			for k, e := range m {
				if ps := s.Properties[k]; ps != nil {
					m[k] = coerce(ps, e)
				} else if s.AdditionalProperties != nil {
					m[k] = coerce(s.AdditionalProperties, e)
				}
			}
		}
	}
	return v
}

// cleanValidationError drops jsonschema-go's "validating root: " noise.
func cleanValidationError(err error) string {
	msg := err.Error()
	msg = strings.ReplaceAll(msg, "validating root: ", "")
	msg = strings.ReplaceAll(msg, "validating /properties/", "")
	return msg
}

// checkArgs validates arguments against a tool's flat schema (the only
// constructs inputSchema produces: strings, integers, booleans, arrays of
// strings, objects of strings; required, enum, minimum, maximum, minItems),
// with messages meant for an agent. Undeclared arguments are gone already.
func checkArgs(s *jsonschema.Schema, args map[string]any) error {
	var missing []string
	for _, name := range s.Required {
		if _, ok := args[name]; !ok {
			missing = append(missing, strconv.Quote(name))
		}
	}
	if len(missing) == 1 {
		return fmt.Errorf("missing required argument %s", missing[0])
	}
	if len(missing) > 1 {
		return fmt.Errorf("missing required arguments %s", strings.Join(missing, ", "))
	}
	for _, name := range s.PropertyOrder {
		v, ok := args[name]
		if !ok {
			continue
		}
		if err := checkValue(s.Properties[name], v); err != nil {
			return fmt.Errorf("argument %q: %v", name, err)
		}
	}
	return nil
}

func checkValue(s *jsonschema.Schema, v any) error {
	switch s.Type {
	case "string":
		str, ok := v.(string)
		if !ok {
			return fmt.Errorf("want a string, got %s", jsonType(v))
		}
		if len(s.Enum) > 0 && !slices.Contains(s.Enum, any(str)) {
			var names []string
			for _, e := range s.Enum {
				if e != "" { // "" is the default's other name
					names = append(names, fmt.Sprint(e))
				}
			}
			return fmt.Errorf("%q is not one of %s", str, strings.Join(names, ", "))
		}
	case "integer":
		f, ok := v.(float64)
		if !ok || f != math.Trunc(f) {
			return fmt.Errorf("want an integer, got %s", jsonType(v))
		}
		lo, hi := bounds(s)
		if lo != nil && f < *lo {
			return fmt.Errorf("%v is less than the minimum %v", f, *lo)
		}
		if hi != nil && f > *hi {
			return fmt.Errorf("%v is more than the maximum %v", f, *hi)
		}
		if f < math.MinInt32 || f > math.MaxInt32 {
			return fmt.Errorf("%v is out of range", f)
		}
	case "boolean":
		if _, ok := v.(bool); !ok {
			return fmt.Errorf("want true or false, got %s", jsonType(v))
		}
	case "array":
		l, ok := v.([]any)
		if !ok {
			return fmt.Errorf("want an array, got %s", jsonType(v))
		}
		if s.MinItems != nil && len(l) < *s.MinItems {
			if *s.MinItems == 1 {
				return fmt.Errorf("must not be empty")
			}
			return fmt.Errorf("want at least %d items, got %d", *s.MinItems, len(l))
		}
		if s.Items != nil {
			for i, e := range l {
				if err := checkValue(s.Items, e); err != nil {
					return fmt.Errorf("item %d: %v", i, err)
				}
			}
		}
	case "object":
		m, ok := v.(map[string]any)
		if !ok {
			return fmt.Errorf("want an object, got %s", jsonType(v))
		}
		if s.AdditionalProperties != nil {
			for _, k := range slices.Sorted(maps.Keys(m)) {
				if err := checkValue(s.AdditionalProperties, m[k]); err != nil {
					return fmt.Errorf("key %q: %v", k, err)
				}
			}
		}
	}
	return nil
}

func jsonType(v any) string {
	switch v := v.(type) {
	case nil:
		return "null"
	case string:
		return "a string"
	case bool:
		return "a boolean"
	case float64:
		if v == math.Trunc(v) {
			return "an integer"
		}
		return "a number"
	case []any:
		return "an array"
	case map[string]any:
		return "an object"
	}
	return fmt.Sprintf("%T", v)
}
