package attest

import (
	"context"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/google/go-tpm/tpm2"
)

// Command is `vm-agent attest`; it returns the exit code. Flag errors exit 1, not
// 2, because 2 means "rejected" to whoever runs it.
func Command(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("attest", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := Config{
		EventLogPath:     DefaultEventLogPath,
		UserspaceLogPath: DefaultUserspaceLogPath,
		Stdout:           stdout,
		Stderr:           stderr,
	}
	fs.StringVar(&cfg.Stage, "stage", "", "boot stage: initrd or ready (required)")
	fs.StringVar(&cfg.IMDSURL, "imds-url", DefaultIMDSURL, "IMDS base URL")
	fs.StringVar(&cfg.TPMPath, "tpm", DefaultTPMPath, "TPM device, or swtpm's unix server socket")
	fs.DurationVar(&cfg.Timeout, "timeout", DefaultTimeout, "total time for all attempts")
	fs.BoolVar(&cfg.Print, "print", false, "print the JSON request instead of posting it")
	nonce := fs.String("nonce", "", "nonce (hex) to quote instead of one from the IMDS")
	if err := fs.Parse(args); err != nil {
		return ExitError
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "vm-agent attest: unexpected arguments %q\n", fs.Args())
		return ExitError
	}
	if *nonce != "" {
		b, err := hex.DecodeString(*nonce)
		// 64 bytes is the most a TPM2B_DATA takes (the largest digest).
		if err != nil || len(b) > 64 {
			fmt.Fprintln(stderr, "vm-agent attest: --nonce: want up to 64 bytes in hex")
			return ExitError
		}
		cfg.Nonce = b
	}
	if cfg.Timeout <= 0 {
		fmt.Fprintln(stderr, "vm-agent attest: --timeout must be positive")
		return ExitError
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return Run(ctx, cfg)
}

// PCRsCommand is `vm-agent pcrs`: PCRs 0–23 of one bank as "<idx> <hex>" lines.
func PCRsCommand(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("pcrs", flag.ContinueOnError)
	fs.SetOutput(stderr)
	bank := fs.String("bank", "sha256", "PCR bank: sha1, sha256, sha384 or sha512")
	path := fs.String("tpm", DefaultTPMPath, "TPM device, or swtpm's unix server socket")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "vm-agent pcrs: unexpected arguments %q\n", fs.Args())
		return 2
	}
	alg, ok := Banks[*bank]
	if !ok {
		fmt.Fprintf(stderr, "vm-agent pcrs: unknown bank %q\n", *bank)
		return 2
	}
	if err := printPCRs(stdout, *path, alg); err != nil {
		fmt.Fprintln(stderr, "vm-agent pcrs:", err)
		return 1
	}
	return 0
}

func printPCRs(w io.Writer, path string, alg tpm2.TPMAlgID) error {
	t, err := OpenTPM(path)
	if err != nil {
		return err
	}
	defer t.Close()
	idx := make([]uint, 24)
	for i := range idx {
		idx[i] = uint(i)
	}
	values, err := ReadPCRs(t, alg, idx)
	if err != nil {
		return err
	}
	for _, i := range idx {
		if _, err := fmt.Fprintf(w, "%d %x\n", i, values[i]); err != nil {
			return err
		}
	}
	return nil
}
