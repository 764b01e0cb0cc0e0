package catalog

import (
	"strings"
	"testing"
)

func TestPolicy(t *testing.T) {
	const (
		own    = `{"pcr11": {"enter-initrd": "01"}, "source": "own"}`
		shared = `{"pcr11": {"enter-initrd": "02"}, "source": "shared"}`
	)
	tests := []struct {
		name       string
		files      map[string]string
		wantSource string // "" = no policy
		wantWarn   string
	}{
		{name: "none"},
		{
			name:       "own policy",
			files:      map[string]string{"base_1.policy.json": own},
			wantSource: "own",
		},
		{
			name:       "own policy beats the shared one",
			files:      map[string]string{"base_1.policy.json": own, "policy.json": shared},
			wantSource: "own",
		},
		{
			name:       "shared without image keys",
			files:      map[string]string{"policy.json": shared},
			wantSource: "shared",
		},
		{
			name:       "shared with matching keys",
			files:      map[string]string{"policy.json": `{"image_id": "base", "image_version": "1", "source": "shared"}`},
			wantSource: "shared",
		},
		{
			name:       "shared with matching id only",
			files:      map[string]string{"policy.json": `{"image_id": "base", "source": "shared"}`},
			wantSource: "shared",
		},
		{
			name:  "shared for another image id",
			files: map[string]string{"policy.json": `{"image_id": "other", "image_version": "1", "source": "shared"}`},
		},
		{
			name:  "shared for another version",
			files: map[string]string{"policy.json": `{"image_id": "base", "image_version": "2", "source": "shared"}`},
		},
		{
			name:  "shared with a non-string image_id",
			files: map[string]string{"policy.json": `{"image_id": 1, "source": "shared"}`},
		},
		{
			name:     "invalid own policy: nil, no fallback to shared",
			files:    map[string]string{"base_1.policy.json": `{"pcr11": `, "policy.json": shared},
			wantWarn: "image policy ignored",
		},
		{
			name:     "own policy that is not an object",
			files:    map[string]string{"base_1.policy.json": `[1, 2]`},
			wantWarn: "image policy ignored",
		},
		{
			name:     "invalid shared policy",
			files:    map[string]string{"policy.json": `nope`},
			wantWarn: "shared policy ignored",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := map[string]string{"base_1.efi": "", "base_1.raw": ""}
			for k, v := range tt.files {
				fs[k] = v
			}
			c, logs := load(t, files(t, fs))
			img, err := c.Get("base_1")
			if err != nil {
				t.Fatalf("Get: %v (the catalog must survive a bad policy)", err)
			}
			doc, ok := c.PolicyDocument("base_1")
			if tt.wantSource == "" {
				if img.Policy != nil || ok || doc != nil {
					t.Errorf("policy = %v, document %q %v; want none", img.Policy, doc, ok)
				}
			} else {
				if got := img.Policy.GetFields()["source"].GetStringValue(); got != tt.wantSource {
					t.Errorf("policy source = %q, want %q", got, tt.wantSource)
				}
				if !ok || !strings.Contains(string(doc), `"source": "`+tt.wantSource+`"`) {
					t.Errorf("document = %q, %v", doc, ok)
				}
			}
			if tt.wantWarn != "" && !strings.Contains(logs.String(), tt.wantWarn) {
				t.Errorf("logs lack %q:\n%s", tt.wantWarn, logs.String())
			}
		})
	}
}

func TestPolicyDocumentLookup(t *testing.T) {
	c, _ := load(t, files(t, map[string]string{
		"base_1.efi": "", "base_1.raw": "", "base_1.policy.json": `{"v": "1"}`,
		"base_2.efi": "", "base_2.raw": "", "base_2.policy.json": `{"v": "2"}`,
	}))
	if doc, ok := c.PolicyDocument("base"); !ok || string(doc) != `{"v": "2"}` {
		t.Errorf("bare id: %q %v", doc, ok)
	}
	if doc, ok := c.PolicyDocument("base_1"); !ok || string(doc) != `{"v": "1"}` {
		t.Errorf("ref: %q %v", doc, ok)
	}
	for _, ref := range []string{"base_3", "../base_1", ""} {
		if doc, ok := c.PolicyDocument(ref); ok || doc != nil {
			t.Errorf("PolicyDocument(%q) = %q, %v", ref, doc, ok)
		}
	}
	// The returned bytes are a copy.
	doc, _ := c.PolicyDocument("base_1")
	doc[0] = 'X'
	if again, _ := c.PolicyDocument("base_1"); string(again) != `{"v": "1"}` {
		t.Errorf("catalog document changed through a returned slice: %q", again)
	}
}
