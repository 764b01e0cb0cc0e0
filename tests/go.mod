module github.com/giantswarm/vm-manager/tests

go 1.26.0

require (
	github.com/giantswarm/vm-manager/gen v0.0.0
	github.com/giantswarm/vm-manager/pkg v0.0.0 // indirect
)

replace (
	github.com/giantswarm/vm-manager/gen => ../gen
	github.com/giantswarm/vm-manager/pkg => ../pkg
)

require (
	github.com/giantswarm/vm-manager/services/attestation v0.0.0
	github.com/giantswarm/vm-manager/services/gateway v0.0.0
	github.com/giantswarm/vm-manager/services/hypervisor v0.0.0
	github.com/google/go-tpm v0.9.8
	google.golang.org/grpc v1.85.0
)

require (
	github.com/digitalocean/go-libvirt v0.0.0-20220804181439-8648fbde413e // indirect
	github.com/digitalocean/go-qemu v0.0.0-20250212194115-ee9b0668d242 // indirect
	github.com/google/go-eventlog v0.0.3-0.20260617163629-883cc5652c69 // indirect
	github.com/grpc-ecosystem/grpc-gateway/v2 v2.33.0 // indirect
	github.com/mdlayher/socket v0.8.0 // indirect
	github.com/mdlayher/vsock v1.4.0 // indirect
	go.etcd.io/bbolt v1.5.0 // indirect
	golang.org/x/net v0.62.0 // indirect
	golang.org/x/sync v0.24.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
	golang.org/x/text v0.43.0 // indirect
	google.golang.org/genproto/googleapis/api v0.0.0-20261026165753-2ffab32bce7e // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20261026165753-2ffab32bce7e // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)

replace (
	github.com/giantswarm/vm-manager/services/attestation => ../services/attestation
	github.com/giantswarm/vm-manager/services/gateway => ../services/gateway
	github.com/giantswarm/vm-manager/services/hypervisor => ../services/hypervisor
)
