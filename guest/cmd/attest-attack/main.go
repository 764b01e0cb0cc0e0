// Command attest-attack is the guest side of the attestation attack suite
// (tests/attacks_test.go): copied into a running test guest, it does what a
// hostile guest with root can do against the IMDS. It is part of no image.
//
//	attest-attack forge --stage initrd|ready   quote the vTPM's real PCRs with a software key
//	attest-attack nonce                        fetch a nonce, print it in hex
//	attest-attack submit FILE                  post a quote request (vm-agent attest --print)
//	attest-attack user-data                    GET /user-data
//
// Each prints one line per request: "<what>: <status> <body>".
package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/pkg/imdswire"
	"github.com/giantswarm/vm-manager/pkg/vtpm/vtpmtest"
	"github.com/google/go-tpm/tpm2"
)

var (
	base   = imdsclient.DefaultURL
	client = &http.Client{Timeout: 20 * time.Second}
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: attest-attack forge|nonce|submit|user-data ...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "forge":
		err = forge(os.Args[2:])
	case "nonce":
		var n []byte
		if n, err = nonce(); err == nil {
			fmt.Println(hex.EncodeToString(n))
		}
	case "submit":
		if len(os.Args) != 3 {
			err = fmt.Errorf("submit FILE")
			break
		}
		var body []byte
		if body, err = os.ReadFile(os.Args[2]); err == nil {
			err = post("quote", body)
		}
	case "user-data":
		err = userData()
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "attest-attack:", err)
		os.Exit(1)
	}
}

// forge reads the PCRs the vTPM really holds (a golden boot's, when the
// guest booted the golden image) and signs a quote over them with a key that
// lives in this process, whose public area claims the AK template: exactly
// what an AK quote looks like, from a key no TPM holds.
func forge(args []string) error {
	fs := flag.NewFlagSet("forge", flag.ContinueOnError)
	stage := fs.String("stage", attest.StageInitrd, "initrd or ready")
	tpmPath := fs.String("tpm", attest.DefaultTPMPath, "TPM to read the PCRs from")
	if err := fs.Parse(args); err != nil {
		return err
	}
	idx, err := attest.StagePCRs(*stage)
	if err != nil {
		return err
	}
	t, err := attest.OpenTPM(*tpmPath)
	if err != nil {
		return err
	}
	values, err := attest.ReadPCRs(t, tpm2.TPMAlgSHA256, idx)
	t.Close()
	if err != nil {
		return err
	}
	key, err := vtpmtest.NewSoftwareAK()
	if err != nil {
		return err
	}
	n, err := nonce()
	if err != nil {
		return err
	}
	pcrs := map[uint32][]byte{}
	req := imdswire.QuoteRequest{Stage: *stage, Nonce: hex.EncodeToString(n), AKPub: key.Public, PCRs: map[string]map[string]string{"sha256": {}}}
	for i, v := range values {
		pcrs[uint32(i)] = v
		req.PCRs["sha256"][strconv.Itoa(int(i))] = hex.EncodeToString(v)
	}
	if req.Quote, req.Signature, err = key.Quote(n, pcrs); err != nil {
		return err
	}
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	if err := post("quote", body); err != nil {
		return err
	}
	return userData()
}

func nonce() ([]byte, error) {
	status, body, err := do(http.MethodGet, "/attest/nonce", nil)
	if err != nil {
		return nil, err
	}
	if status != http.StatusOK {
		return nil, fmt.Errorf("nonce: %d %s", status, body)
	}
	return hex.DecodeString(strings.TrimSpace(string(body)))
}

func post(what string, body []byte) error {
	status, resp, err := do(http.MethodPost, "/attest/quote", body)
	if err != nil {
		return err
	}
	fmt.Printf("%s: %d %s\n", what, status, bytes.TrimSpace(resp))
	return nil
}

func userData() error {
	status, body, err := do(http.MethodGet, "/user-data", nil)
	if err != nil {
		return err
	}
	fmt.Printf("user-data: %d %s\n", status, bytes.TrimSpace(body))
	return nil
}

func do(method, path string, body []byte) (int, []byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, base+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, b, err
}
