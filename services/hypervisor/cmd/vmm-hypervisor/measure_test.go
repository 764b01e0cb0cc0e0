package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

func TestParsePCRs(t *testing.T) {
	got, err := parsePCRs(" 7,2, 4,2 ")
	if err != nil || len(got) != 3 || got[0] != 2 || got[2] != 7 {
		t.Errorf("parsePCRs = %v, %v", got, err)
	}
	for _, bad := range []string{"", "24", "1,,2", "x", "-1"} {
		if _, err := parsePCRs(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// The measured values replace golden and golden_firmware; everything else
// the policy said (PCR 11, sysext, …) stays.
func TestWriteGoldenKeepsThePolicy(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img_1.policy.json")
	base := []byte(`{"image_id":"img","image_version":"1","pcr11":{"enter-initrd":"aa"},"golden":{"sha256":{"0":"old","5":"old"}},"golden_firmware":{"sha256":"old"}}`)
	img := &hypervisorv1.Image{Id: "img", Version: "1", Ref: "img_1"}
	values := map[uint32][]byte{4: bytes.Repeat([]byte{4}, 32), 12: make([]byte, 32)}
	if err := writeGolden(path, img, base, values, &hypervisorv1.Firmware{Sha256: "ab", Package: "ovmf", Version: "1"}); err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	b, _ := os.ReadFile(path)
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	golden := doc["golden"].(map[string]any)["sha256"].(map[string]any)
	if len(golden) != 2 || golden["4"] != "0404040404040404040404040404040404040404040404040404040404040404" || golden["12"] == nil {
		t.Errorf("golden %v", golden)
	}
	if fw := doc["golden_firmware"].(map[string]any); fw["sha256"] != "ab" || fw["package"] != "ovmf" {
		t.Errorf("golden_firmware %v", fw)
	}
	if doc["pcr11"] == nil || doc["image_id"] != "img" {
		t.Errorf("other fields lost: %s", b)
	}
}
