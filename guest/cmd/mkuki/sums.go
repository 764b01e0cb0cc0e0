package main

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"os"
	"strings"

	"github.com/giantswarm/vm-manager/pkg/measure"
)

// kubernetes reads the Kubernetes sysext tree's SHA256SUMS: for each
// kubernetes_<v>.raw, its sha256 (policy "sysext") and the PCR 13 the guest
// reaches after measuring it (policy "pcr13", contract §5.5).
func kubernetes(path string) (sysext, pcr13 map[string]string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	sysext, pcr13 = map[string]string{}, map[string]string{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		sum, file, ok := strings.Cut(line, " ")
		file = strings.TrimPrefix(strings.TrimLeft(file, " "), "*")
		if d, err := hex.DecodeString(sum); !ok || err != nil || len(d) != 32 {
			return nil, nil, fmt.Errorf("%s:%d: want \"<sha256>  <file>\", got %q", path, n, line)
		}
		v, isK8s := strings.CutPrefix(file, "kubernetes_")
		v, isRaw := strings.CutSuffix(v, ".raw")
		if !isK8s || !isRaw || v == "" {
			continue
		}
		if _, dup := sysext[v]; dup {
			return nil, nil, fmt.Errorf("%s:%d: kubernetes %s is listed twice", path, n, v)
		}
		sum = strings.ToLower(sum)
		sysext[v] = sum
		pcr13[v] = hex.EncodeToString(measure.PCR13(measure.SysextLine(sum, measure.SysextFile(v))))
	}
	return sysext, pcr13, sc.Err()
}
