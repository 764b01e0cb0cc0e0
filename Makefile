# vm-manager: three processes (hypervisor, attestation, gateway) in one pod.
#
#   make run        start all three on 127.0.0.1:8080, anonymous, local state in ./.run
#   make test       every test: unit, integration with real QEMU/swtpm, the three binaries
#   make generate   regenerate gen/ from proto/ (pinned buf and plugins in ./bin)
#   make bench      benchmarks, ratios side by side

SHELL := /bin/bash
.DEFAULT_GOAL := build

BIN        := $(CURDIR)/bin
RUN_STATE  ?= $(CURDIR)/.run
# Where `make guest-image` puts the test guest and `make run` finds images.
IMAGE_DIR  ?= $(RUN_STATE)/state/images
export PATH := $(BIN):$(PATH)

# Pinned tool versions: generation must be byte-for-byte reproducible.
BUF_VERSION                := 1.75.0
PROTOC_GEN_GO_VERSION      := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
GRPC_GATEWAY_VERSION       := v2.33.0
GRPCURL_VERSION            := v1.9.4

MODULES  := gen sdk guest pkg services/hypervisor services/attestation services/gateway tests examples/sdk examples/shell deploy/mkimage deploy/charttest
SERVICES := hypervisor attestation gateway
GO_PKGS   = $(shell go list -m -f '{{.Dir}}/...' | sed 's|$(CURDIR)/|./|')
# The unit packages run under the race detector in make test: a new data race
# fails it. The end-to-end suites (tests/, the examples, the chart) drive the
# real binaries, which are built without it.
RACE_PKGS  := ./gen/... ./sdk/... ./guest/... ./pkg/... ./services/hypervisor/... ./services/attestation/... ./services/gateway/...
OTHER_PKGS  = $(filter-out $(RACE_PKGS),$(GO_PKGS))

VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT  ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS := -X github.com/giantswarm/vm-manager/pkg/buildinfo.Version=$(VERSION) \
           -X github.com/giantswarm/vm-manager/pkg/buildinfo.Commit=$(COMMIT)

.PHONY: build
build: ## build the three binaries into ./bin
	@mkdir -p $(BIN)
	@for s in $(SERVICES); do \
	  (cd services/$$s && CGO_ENABLED=0 go build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/vmm-$$s ./cmd/vmm-$$s) || exit 1; \
	done

# ---- tools ------------------------------------------------------------------

$(BIN)/buf:
	@mkdir -p $(BIN)/.buf
	npm install --silent --no-save --no-audit --no-fund --prefix $(BIN)/.buf @bufbuild/buf@$(BUF_VERSION)
	ln -sf .buf/node_modules/@bufbuild/buf-linux-x64/bin/buf $@
	@$@ --version | grep -qx '$(BUF_VERSION)'

$(BIN)/protoc-gen-go:
	GOBIN=$(BIN) GOWORK=off go install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
$(BIN)/protoc-gen-go-grpc:
	GOBIN=$(BIN) GOWORK=off go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
$(BIN)/protoc-gen-grpc-gateway:
	GOBIN=$(BIN) GOWORK=off go install github.com/grpc-ecosystem/grpc-gateway/v2/protoc-gen-grpc-gateway@$(GRPC_GATEWAY_VERSION)
$(BIN)/protoc-gen-openapiv3:
	GOBIN=$(BIN) GOWORK=off go install github.com/grpc-ecosystem/grpc-gateway/v2/protoc-gen-openapiv3@$(GRPC_GATEWAY_VERSION)
$(BIN)/grpcurl:
	GOBIN=$(BIN) GOWORK=off go install github.com/fullstorydev/grpcurl/cmd/grpcurl@$(GRPCURL_VERSION)

GEN_TOOLS := $(BIN)/buf $(BIN)/protoc-gen-go $(BIN)/protoc-gen-go-grpc $(BIN)/protoc-gen-grpc-gateway $(BIN)/protoc-gen-openapiv3

.PHONY: tools
tools: $(GEN_TOOLS) $(BIN)/grpcurl ## install pinned tools into ./bin

# ---- generation -------------------------------------------------------------

.PHONY: generate
generate: $(GEN_TOOLS) ## regenerate gen/ (Go SDK, gateway, OpenAPI) from proto/
	rm -rf build/openapi
	find gen services/hypervisor/internal/vmstore/storepb -name '*.pb.go' -o -name '*.pb.gw.go' | xargs -r rm -f
	buf generate
	buf generate --template buf.gen.store.yaml
	go run ./services/gateway/cmd/openapi-gen -in build/openapi -out gen/openapi
	rm -rf services/gateway/cmd/openapi-gen/testdata/openapi
	mv build/openapi services/gateway/cmd/openapi-gen/testdata/openapi

.PHONY: lint
lint: $(BIN)/buf ## buf lint, gofmt, go vet
	buf lint
	@test -z "$$(gofmt -l $(MODULES))" || { gofmt -l $(MODULES); echo "gofmt: files above need formatting"; exit 1; }
	go vet $(GO_PKGS)

.PHONY: breaking
breaking: $(BIN)/buf ## buf breaking against main (skipped when main does not have the protos yet)
	@if git rev-parse -q --verify main >/dev/null && git cat-file -e main:buf.yaml 2>/dev/null; then \
	  buf breaking --against '.git#branch=main'; \
	else echo "buf breaking: main has no buf.yaml yet; nothing to compare"; fi

GENERATED := gen services/hypervisor/internal/vmstore/storepb services/gateway/cmd/openapi-gen/testdata

.PHONY: check-generated
check-generated: generate ## fail when gen/ is stale
	@changed=$$(git diff --name-only -- $(GENERATED); git ls-files --others --exclude-standard -- $(GENERATED)); \
	if [ -n "$$changed" ]; then echo "$$changed"; echo "gen/ is stale: run 'make generate' and commit the result"; exit 1; fi

# ---- test -------------------------------------------------------------------

.PHONY: deps
deps: ## install the Debian packages the tests need (QEMU, swtpm, OVMF)
	./hack/install-deps.sh

.PHONY: guest-image
guest-image: ## build the test guest (Debian cloud kernel + vm-agent initramfs) into $(IMAGE_DIR)
	./hack/guest-image.sh $(IMAGE_DIR)

# vm-base, the real OS image (Debian 13, systemd, erofs + dm-verity, Ignition):
# hack/os-image.sh, as root; its trees and Ignition build are cached in VMM_OS_CACHE.
OS_IMAGE_DIR ?= $(CURDIR)/build/os/images

.PHONY: os-image
os-image: ## build vm-base (UKI, disk, policy, Kubernetes sysext) into $(OS_IMAGE_DIR); docs/guest.md
	./hack/os-image.sh $(OS_IMAGE_DIR)

# Reproducibility: a second build from scratch (its own cache: the trees bootstrapped
# again, Ignition built again, another measuring boot) must give the same bytes.
.PHONY: os-image-reproducible
os-image-reproducible: os-image ## build vm-base a second time from an empty cache and compare every output byte for byte
	rm -rf $(CURDIR)/build/os/images-2 $(CURDIR)/build/os/cache-2
	VMM_OS_CACHE=$(CURDIR)/build/os/cache-2 ./hack/os-image.sh $(CURDIR)/build/os/images-2
	diff -r $(OS_IMAGE_DIR) $(CURDIR)/build/os/images-2 && echo "os-image: two builds, byte-identical outputs"
	rm -rf $(CURDIR)/build/os/cache-2

# The real-OS suite: vm-base booted with attestation required (tests/vmbase_test.go).
.PHONY: test-os
test-os: build os-image ## boot vm-base: Ignition behind the gate, IMDS provisioning, OpenSSH, reboot, PCR 13, tampering
	cd tests && VMM_OS_IMAGE_DIR=$(OS_IMAGE_DIR) go test -count=1 -timeout 60m -run '^TestVMBase$$' -v .

.PHONY: test
test: deps tools check-generated lint breaking build guest-image ## everything but the long suites (test-long); CI runs both
	VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) go test -race -count=1 -timeout 45m $(RACE_PKGS)
	VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) go test -count=1 -timeout 45m -skip '$(LONG_SUITES)' $(OTHER_PKGS)
	$(MAKE) fuzz

# The longest guest suites (several minutes each, mostly TCG boots) run in
# their own target so that make test stays near 20 minutes; .ci/run runs both.
LONG_SUITES := ^(TestVMLifecycle|TestVMLifetimes|TestOCIImage|TestWarmPool|TestFork|TestForkDisk)$$

.PHONY: test-long
test-long: build guest-image ## the long guest suites make test leaves out (full VM lifecycle, lifetimes, OCI images, warm pools, forks with and without a disk)
	cd tests && VMM_TEST_IMAGE_DIR=$${VMM_TEST_IMAGE_DIR:-$(IMAGE_DIR)} go test -count=1 -timeout 30m -run '$(LONG_SUITES)' -v .

# The fault suite (tests/faults_test.go): random VM operations with SIGKILL and
# restart of the three processes, then invariants. FAULTS_SEED=<n> replays a
# run's choices, FAULTS_EVENTS sets the number of kill/restart events (30).
.PHONY: test-faults
test-faults: ## the fault suite: 4-6 minutes of VM operations and SIGKILLs, then invariants (docs/reliability.md)
	cd tests && FAULTS=1 FAULTS_SEED=$(FAULTS_SEED) FAULTS_EVENTS=$(FAULTS_EVENTS) VMM_TEST_IMAGE_DIR=$${VMM_TEST_IMAGE_DIR:-$(IMAGE_DIR)} go test -count=1 -timeout 30m -run '^TestFaults$$' -v .

# The load test (tests/load_test.go): LOAD_CLIENTS clients for LOAD_DURATION
# over REST, gRPC and MCP against the three binaries while two test guests run
# (make guest-image first; make test builds it). Fails on any error, a VM no
# longer ready, or a process whose RSS grew by more than 100 MiB; prints the
# table kept in docs/reliability.md.
LOAD_CLIENTS  ?= 200
LOAD_DURATION ?= 60s

.PHONY: test-load
test-load: ## the load test: 200 clients for 60 s, zero errors, p50/p99 and calls/s per surface, RSS
	cd tests && LOAD=1 LOAD_CLIENTS=$(LOAD_CLIENTS) LOAD_DURATION=$(LOAD_DURATION) VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) go test -count=1 -timeout 20m -run '^TestLoad$$' -v .

# A count, not a duration: go1.26's fuzz coordinator can fail a target with a bare
# "context deadline exceeded" when a duration's deadline races a busy worker
# (golang/go#75804, fixed in go1.27); a count has no deadline to race. 100,000
# inputs take 7-20 s per target on these machines. FUZZTIME=60s still works for a
# longer exploring run.
FUZZTIME ?= 100000x

.PHONY: fuzz
fuzz: ## the fuzz targets, $(FUZZTIME) inputs each (bounded, run by make test)
	cd services/attestation && go test -run '^$$' -fuzz '^FuzzCheck$$' -fuzztime $(FUZZTIME) ./internal/verify/
	cd services/attestation && go test -run '^$$' -fuzz '^FuzzEventLog$$' -fuzztime $(FUZZTIME) ./internal/verify/
	cd services/attestation && go test -run '^$$' -fuzz '^FuzzFastParsers$$' -fuzztime $(FUZZTIME) ./internal/verify/
	cd services/hypervisor && go test -run '^$$' -fuzz '^FuzzIMDS$$' -fuzztime $(FUZZTIME) ./internal/imds/
	cd services/hypervisor && go test -run '^$$' -fuzz '^FuzzNotify$$' -fuzztime $(FUZZTIME) ./internal/notify/
	cd services/hypervisor && go test -run '^$$' -fuzz '^FuzzGuestReport$$' -fuzztime $(FUZZTIME) ./internal/guestapi/
	cd services/gateway && go test -run '^$$' -fuzz '^FuzzRESTBody$$' -fuzztime $(FUZZTIME) ./internal/restjson/

.PHONY: test-short
test-short: ## unit tests only
	go test -short -count=1 $(GO_PKGS)

# create→ready also runs on Debian 12's 2 MiB OVMF build, interleaved, when it is
# installed: the opt-in firmware's gain measured in the same run.
BENCH_OTHER_OVMF ?= $(shell test -f /usr/share/OVMF/OVMF_CODE.fd && echo /usr/share/OVMF/OVMF_CODE.fd,/usr/share/OVMF/OVMF_VARS.fd)

.PHONY: bench
bench: build guest-image os-image ## benchmarks; ratios are printed side by side
	cd tests && VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) VMM_BENCH_BASELINE_OVMF=$(BENCH_OTHER_OVMF) go test -run '^$$' -bench '^BenchmarkCreateToReady$$' -benchtime 5x .
	cd tests && VMM_OS_IMAGE_DIR=$(OS_IMAGE_DIR) go test -run '^$$' -bench VMBaseCreateToReady -benchtime 2x -timeout 60m .
	cd tests && VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) go test -run '^$$' -bench SuspendResume -benchtime 3x .
	cd tests && VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) go test -run '^$$' -bench WarmPool -benchtime 5x -timeout 30m .
	cd tests && VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) go test -run '^$$' -bench 'Fork$$' -benchtime 2x -timeout 30m .
	cd tests && VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) go test -run '^$$' -bench OCIImage -benchtime 2x -timeout 30m .
	cd tests && go test -run '^$$' -bench VerifyQuote -benchtime 500x .
	cd services/attestation && GOMAXPROCS=1 go test -run '^$$' -bench VerifyQuoteInProcess -benchtime 2000x ./internal/apiserver/
	cd tests && VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) go test -run '^$$' -bench Surfaces -benchtime 1x .
	cd tests && VMM_TEST_IMAGE_DIR=$(IMAGE_DIR) go test -run '^$$' -bench ExecStream -benchtime 3x .
	cd tests && go test -run '^$$' -bench FleetList -benchtime 1x .
	cd services/attestation && go test -run '^$$' -bench . ./internal/verify/
	cd services/attestation && go test -run '^$$' -bench . -benchtime 300x ./internal/nonce/

# ---- images -----------------------------------------------------------------

# Images built without a Docker daemon (deploy/mkimage); the hypervisor image needs
# Debian's QEMU, swtpm and OVMF: docker build --target hypervisor -f deploy/docker/Dockerfile .
DAEMONLESS_IMAGES := gateway attestation

.PHONY: images
images: build guest-image-artifact ## gateway and attestation OCI image layouts in build/images/<name> (no Docker daemon), and the guest image
	@for s in $(DAEMONLESS_IMAGES); do \
	  (cd deploy/mkimage && go run . -name $$s -binary $(BIN)/vmm-$$s -out $(CURDIR)/build/images/$$s \
	    -version '$(VERSION)' -revision '$(COMMIT)') || exit 1; \
	done

# The guest image artifact the chart's init container pulls (docs/deploy.md): the
# test guests and vm-base, as an OCI layout tagged $(VERSION) in build/images/guest-image,
# for a release to copy to the registry (oras cp --from-oci-layout, skopeo).
GUEST_ARTIFACT_DIR := $(CURDIR)/build/guest-artifact

.PHONY: guest-image-artifact
guest-image-artifact: build guest-image os-image ## the guest image OCI artifact (test guests + vm-base) in build/images/guest-image
	rm -rf $(GUEST_ARTIFACT_DIR) $(CURDIR)/build/images/guest-image && mkdir -p $(GUEST_ARTIFACT_DIR)
	cp -RLl $(IMAGE_DIR)/test-guest* $(IMAGE_DIR)/sysupdate $(OS_IMAGE_DIR)/vm-base_* $(GUEST_ARTIFACT_DIR)/
	$(BIN)/vmm-hypervisor image push $(GUEST_ARTIFACT_DIR) '$(VERSION)' --oci-layout $(CURDIR)/build/images/guest-image

# ---- run --------------------------------------------------------------------

.PHONY: run
run: build guest-image ## all three processes in the foreground, anonymous on 127.0.0.1:8080 (with vm-base once make os-image built it)
	@for f in $(OS_IMAGE_DIR)/vm-base_*; do [ -e "$$f" ] && ln -sfn "$$f" $(IMAGE_DIR)/ || true; done
	./hack/run.sh $(RUN_STATE)

.PHONY: clean
clean:
	rm -rf $(BIN) build .run
