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

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/google/jsonschema-go/jsonschema"
)

// namedDefaults are defaults the hypervisor applies too: one definition, in
// the SDK, for both.
var namedDefaults = map[string]any{
	"cpus":      hypervisorv1.DefaultCPUs,
	"memoryMiB": hypervisorv1.DefaultMemoryMiB,
	"diskGiB":   hypervisorv1.DefaultDiskGiB,
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
//
// Pointer fields (optional scalars whose absence matters) get the plain type
// instead of jsonschema-go's ["null", T]: an explicit null is a bad argument.
func inputSchema[In any]() (*jsonschema.Schema, *jsonschema.Resolved, error) {
	s, err := jsonschema.For[In](nil)
	if err != nil {
		return nil, nil, err
	}
	t := reflect.TypeFor[In]()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		ps := s.Properties[name]
		if ps == nil {
			return nil, nil, fmt.Errorf("%s: no schema for property %q", t, name)
		}
		if len(ps.Types) == 2 && ps.Types[0] == "null" {
			ps.Type, ps.Types = ps.Types[1], nil
		}
		tag, ok := f.Tag.Lookup("schema")
		if !ok {
			continue
		}
		for _, kv := range strings.Split(tag, ",") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return nil, nil, fmt.Errorf("%s.%s: bad schema tag %q", t, f.Name, kv)
			}
			switch k {
			case "min", "max":
				n, err := strconv.ParseFloat(v, 64)
				if err != nil {
					return nil, nil, fmt.Errorf("%s.%s: %s: %w", t, f.Name, k, err)
				}
				if k == "min" {
					ps.Minimum = &n
				} else {
					ps.Maximum = &n
				}
			case "minItems":
				n, err := strconv.Atoi(v)
				if err != nil {
					return nil, nil, fmt.Errorf("%s.%s: %s: %w", t, f.Name, k, err)
				}
				ps.MinItems = &n
			case "default":
				if name, ok := strings.CutPrefix(v, "@"); ok {
					d, known := namedDefaults[name]
					if !known {
						return nil, nil, fmt.Errorf("%s.%s: no default named %q", t, f.Name, name)
					}
					b, _ := json.Marshal(d)
					v = string(b)
				}
				if !json.Valid([]byte(v)) {
					return nil, nil, fmt.Errorf("%s.%s: default %q is not JSON", t, f.Name, v)
				}
				ps.Default = json.RawMessage(v)
			case "enum":
				for _, e := range strings.Split(v, "|") {
					ps.Enum = append(ps.Enum, e)
				}
			default:
				return nil, nil, fmt.Errorf("%s.%s: unknown schema key %q", t, f.Name, k)
			}
		}
	}
	r, err := s.Resolve(&jsonschema.ResolveOptions{ValidateDefaults: true})
	if err != nil {
		return nil, nil, err
	}
	return s, r, nil
}

// decodeArgs applies the schema's defaults to raw tool arguments, validates
// them and decodes them into in. Every failure is the caller's fault.
func decodeArgs(raw json.RawMessage, r *jsonschema.Resolved, in any) error {
	args := map[string]any{}
	if len(bytes.TrimSpace(raw)) > 0 && !bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		var v any
		if err := json.Unmarshal(raw, &v); err != nil {
			return fmt.Errorf("arguments: %v", err)
		}
		m, ok := v.(map[string]any)
		if !ok {
			return fmt.Errorf("arguments: want a JSON object")
		}
		args = m
	}
	if err := r.ApplyDefaults(&args); err != nil {
		return fmt.Errorf("arguments: %v", err)
	}
	if err := checkArgs(r.Schema(), args); err != nil {
		return err
	}
	// The schema validator is the safety net for anything checkArgs does not
	// cover; its messages are less readable.
	if err := r.Validate(args); err != nil {
		return fmt.Errorf("arguments: %s", cleanValidationError(err))
	}
	b, err := json.Marshal(args)
	if err != nil {
		return fmt.Errorf("arguments: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(in); err != nil {
		return fmt.Errorf("arguments: %v", err)
	}
	return nil
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
// with messages meant for an agent.
func checkArgs(s *jsonschema.Schema, args map[string]any) error {
	var missing, unknown []string
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
	for name := range args {
		if _, ok := s.Properties[name]; !ok {
			unknown = append(unknown, strconv.Quote(name))
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		known := make([]string, 0, len(s.PropertyOrder))
		for _, name := range s.PropertyOrder {
			known = append(known, strconv.Quote(name))
		}
		if len(known) == 0 {
			return fmt.Errorf("unknown argument %s: this tool takes no arguments", strings.Join(unknown, ", "))
		}
		return fmt.Errorf("unknown argument %s (the arguments are %s)", strings.Join(unknown, ", "), strings.Join(known, ", "))
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
			names := make([]string, len(s.Enum))
			for i, e := range s.Enum {
				names[i] = fmt.Sprint(e)
			}
			return fmt.Errorf("%q is not one of %s", str, strings.Join(names, ", "))
		}
	case "integer":
		f, ok := v.(float64)
		if !ok || f != math.Trunc(f) {
			return fmt.Errorf("want an integer, got %s", jsonType(v))
		}
		if s.Minimum != nil && f < *s.Minimum {
			return fmt.Errorf("%v is less than the minimum %v", f, *s.Minimum)
		}
		if s.Maximum != nil && f > *s.Maximum {
			return fmt.Errorf("%v is more than the maximum %v", f, *s.Maximum)
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
