package main

import (
	"bytes"
	"encoding/json"
	"fmt"

	"go.yaml.in/yaml/v3"
)

// render encodes doc as indented JSON and as YAML, both with sorted keys.
func render(doc obj) (js, ym []byte, err error) {
	var jb bytes.Buffer
	enc := json.NewEncoder(&jb)
	enc.SetEscapeHTML(false) // descriptions hold <id>_<version>
	enc.SetIndent("", "  ")
	if err := enc.Encode(doc); err != nil {
		return nil, nil, err
	}
	node, err := yamlNode(doc)
	if err != nil {
		return nil, nil, err
	}
	var yb bytes.Buffer
	ye := yaml.NewEncoder(&yb)
	ye.SetIndent(2)
	if err := ye.Encode(node); err != nil {
		return nil, nil, err
	}
	if err := ye.Close(); err != nil {
		return nil, nil, err
	}
	return jb.Bytes(), yb.Bytes(), nil
}

// yamlNode builds the YAML tree by hand so keys keep JSON's order and
// strings such as "200" stay strings.
func yamlNode(v any) (*yaml.Node, error) {
	scalar := func(tag, value string) *yaml.Node {
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: tag, Value: value}
	}
	switch v := v.(type) {
	case obj:
		n := &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
		for _, k := range sortedKeys(v) {
			val, err := yamlNode(v[k])
			if err != nil {
				return nil, err
			}
			n.Content = append(n.Content, scalar("!!str", k), val)
		}
		return n, nil
	case []any:
		n := &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
		for _, e := range v {
			val, err := yamlNode(e)
			if err != nil {
				return nil, err
			}
			n.Content = append(n.Content, val)
		}
		return n, nil
	case string:
		return scalar("!!str", v), nil
	case bool:
		if v {
			return scalar("!!bool", "true"), nil
		}
		return scalar("!!bool", "false"), nil
	case json.Number:
		if _, err := v.Int64(); err == nil {
			return scalar("!!int", v.String()), nil
		}
		return scalar("!!float", v.String()), nil
	case nil:
		return scalar("!!null", "null"), nil
	default:
		return nil, fmt.Errorf("unexpected JSON value of type %T", v)
	}
}
