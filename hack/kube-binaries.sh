#!/usr/bin/env bash
# hack/kube-binaries.sh VERSION OUTDIR
#
# Kubernetes binaries for vm-base's system extension (KUBE_BIN_DIR of hack/os-image.sh).
# Build static, reproducible kubelet / kubeadm / kubectl for linux from the Go
# module proxy alone (no git, no dl.k8s.io, no vendor tarball).
#
# k8s.io/kubernetes' go.mod replaces its staging modules (k8s.io/api, ...) with
# ./staging/src/k8s.io/<name>, which `go install pkg@version` rejects and which
# are not inside the module zip anyway. We therefore generate a throw-away
# wrapper module whose go.mod
#   * requires k8s.io/kubernetes VERSION,
#   * replaces every staging module with its published twin k8s.io/<name> v0.X.Y
#     (vX.Y.Z of kubernetes <=> v0.Y.Z of the staging modules),
#   * copies kubernetes' own non-local replace directives, `go` line and
#     `godebug` lines (so runtime GODEBUG defaults match an upstream build),
# and build the commands from inside it.  Everything is derived from
# kubernetes' go.mod, so a new version needs no hand edits.
#
# Flags mirror hack/lib/golang.sh (non-debug build): -trimpath,
# -tags selinux,notest,grpcnotrace, -ldflags "all=-s -w -X ...version..."
# with CGO_ENABLED=0.
#
# Environment knobs (all optional):
#   WORKDIR      wrapper module dir            (default: $OUTDIR/.wrapper)
#   BINARIES     which cmds to build           (default: "kubectl kubeadm kubelet")
#   GOARCH       target arch                   (default: host arch)
#   GIT_COMMIT   value for gitCommit stamp     (default: empty)
#   BUILD_DATE   value for buildDate stamp     (default: 1970-01-01T00:00:00Z)
#   GOTOOLCHAIN  e.g. go1.24.9 to use the exact Go upstream used (fetched from
#                the module proxy as golang.org/toolchain); default: local go
#   GO           go binary                     (default: go in PATH)
#   NICE         prefix for the compile step   (default: "nice -n 10")
#   RESOLVE_ONLY =1: stop after generating/resolving the wrapper module
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 VERSION OUTDIR   (e.g. $0 v1.34.2 build/os/kube)" >&2
  exit 2
fi
VERSION=$1
OUTDIR=$2
[[ $VERSION == v* ]] || VERSION="v${VERSION}"
if [[ ! $VERSION =~ ^v1\.([0-9]+)\.([0-9]+)(-[0-9A-Za-z.-]+)?$ ]]; then
  echo "unsupported version '$VERSION' (want v1.MINOR.PATCH[-pre])" >&2
  exit 2
fi
KMAJOR=1
KMINOR=${BASH_REMATCH[1]}
STAGING_VERSION="v0.${VERSION#v1.}"          # v1.34.2 -> v0.34.2

GO=${GO:-go}
NICE=${NICE-nice -n 10}
BINARIES=${BINARIES:-kubectl kubeadm kubelet}
BUILD_DATE=${BUILD_DATE:-1970-01-01T00:00:00Z}
GIT_COMMIT=${GIT_COMMIT:-}

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
WORKDIR=${WORKDIR:-$OUTDIR/.wrapper}

# Isolate from any surrounding workspace / user GOFLAGS; keep GOPROXY, GOCACHE,
# GOMODCACHE from the environment.
export GOWORK=off
export GOFLAGS=-buildvcs=false
export CGO_ENABLED=0
export GOOS=linux
export GO111MODULE=on
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}

log() { printf '[build-k8s %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# --- 1. fetch kubernetes' go.mod from the proxy ------------------------------
if [[ -e $WORKDIR && -n $(ls -A "$WORKDIR" 2>/dev/null) && ! -f $WORKDIR/kubernetes.go.mod ]]; then
  echo "refusing to wipe non-empty WORKDIR $WORKDIR (not created by this script)" >&2
  exit 2
fi
rm -rf "$WORKDIR"
mkdir -p "$WORKDIR"
cd "$WORKDIR"
# A scratch go.mod so `go mod download` runs module-aware but outside any project.
printf 'module k8sbuild.local/probe\n' > go.mod
log "resolving k8s.io/kubernetes@$VERSION"
# Only the .mod file is needed here (small); the zip is fetched by `go get` below.
KGOMOD=$("$GO" mod download -json "k8s.io/kubernetes@$VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
[[ -f $KGOMOD ]] || { echo "could not download go.mod of k8s.io/kubernetes@$VERSION" >&2; exit 1; }

# --- 2. derive the wrapper go.mod ---------------------------------------------
# Canonicalise the file (go mod edit -print) and pull out go/godebug/replace.
"$GO" mod edit -print "$KGOMOD" > kubernetes.go.mod
KGO=$(awk '$1=="go"{print $2; exit}' kubernetes.go.mod)

{
  echo "module k8sbuild.local/k8s-$VERSION"
  echo
  echo "go ${KGO}"
  echo
} > go.mod

# godebug: single-line or block form.
awk '
  /^godebug[[:space:]]*\(/ {blk=1; next}
  blk && /^\)/ {blk=0; next}
  blk { sub(/^[[:space:]]+/, ""); if ($0 !~ /^\/\//) print "godebug " $0; next }
  /^godebug[[:space:]]/ {print}
' kubernetes.go.mod >> go.mod

"$GO" mod edit -require="k8s.io/kubernetes@$VERSION"

# replace: "old [ver] => new [ver]", single-line or block form.
nstaging=0
while read -r old oldv arrow new newv; do
  if [[ $oldv == "=>" ]]; then   # no version on the left-hand side
    newv=$new; new=$arrow; arrow=$oldv; oldv=
  fi
  [[ $arrow == "=>" ]] || { echo "cannot parse replace: $old $oldv $arrow $new $newv" >&2; exit 1; }
  lhs=$old${oldv:+@$oldv}
  if [[ $new == ./staging/src/* ]]; then
    mod=${new#./staging/src/}
    [[ $mod == "$old" ]] || { echo "unexpected staging replace $old => $new" >&2; exit 1; }
    "$GO" mod edit -replace="$lhs=$old@$STAGING_VERSION"
    nstaging=$((nstaging + 1))
  elif [[ $new == ./* || $new == ../* || $new == /* ]]; then
    echo "BLOCKER: kubernetes go.mod has a non-staging local replace ($old => $new)" >&2
    exit 1
  else
    "$GO" mod edit -replace="$lhs=$new@$newv"
  fi
done < <(awk '
  /^replace[[:space:]]*\(/ {blk=1; next}
  blk && /^\)/ {blk=0; next}
  blk && /=>/ {sub(/^[[:space:]]+/, ""); sub(/[[:space:]]*\/\/.*/, ""); print; next}
  /^replace[[:space:]].*=>/ {sub(/^replace[[:space:]]+/, ""); sub(/[[:space:]]*\/\/.*/, ""); print}
' kubernetes.go.mod)
log "wrapper: go $KGO, $nstaging staging modules -> $STAGING_VERSION"

# --- 3. resolve the build list & go.sum for exactly the packages we build ------
PKGS=()
for b in $BINARIES; do PKGS+=("k8s.io/kubernetes/cmd/$b"); done
log "go get ${PKGS[*]}"
# `go get pkg@version` fills go.mod/go.sum with what those packages need.
# (main packages cannot be blank-imported, hence no tools.go / go mod tidy.)
if ! "$GO" get "${PKGS[@]/%/@$VERSION}"; then
  echo "BLOCKER: could not resolve the build list. If the error says" >&2
  echo "  '403 Forbidden ... This module version is not available', your GOPROXY does not" >&2
  echo "  serve that module version (e.g. a staging module k8s.io/<x>@$STAGING_VERSION);" >&2
  echo "  pick a kubernetes version whose staging modules are all served." >&2
  exit 1
fi
# Sanity: MVS must not have moved kubernetes or a staging module.
sel=$("$GO" list -m -f '{{.Path}} {{.Version}}{{with .Replace}} => {{.Path}} {{.Version}}{{end}}' k8s.io/kubernetes k8s.io/api k8s.io/client-go k8s.io/component-base)
echo "$sel" >&2
grep -q "^k8s.io/kubernetes $VERSION\$" <<<"$sel" || { echo "kubernetes version moved" >&2; exit 1; }
grep -q "k8s.io/component-base .*=> k8s.io/component-base $STAGING_VERSION\$" <<<"$sel" || { echo "component-base not at $STAGING_VERSION" >&2; exit 1; }

if [[ ${RESOLVE_ONLY:-} == 1 ]]; then
  log "RESOLVE_ONLY=1: wrapper module ready in $WORKDIR"
  exit 0
fi

# --- 4. build ---------------------------------------------------------------
X=()
stamp() {
  X+=("-X 'k8s.io/client-go/pkg/version.$1=$2'" "-X 'k8s.io/component-base/version.$1=$2'")
}
stamp buildDate    "$BUILD_DATE"
stamp gitCommit    "$GIT_COMMIT"
stamp gitTreeState clean
stamp gitVersion   "$VERSION"
stamp gitMajor     "$KMAJOR"
stamp gitMinor     "$KMINOR"
LDFLAGS="all=${X[*]} -s -w"
TAGS=selinux,notest,grpcnotrace

"$GO" version >&2
for b in $BINARIES; do
  log "building $b"
  start=$(date +%s)
  # -mod=readonly: go.mod/go.sum are complete after `go get`; fail rather than drift.
  $NICE "$GO" build -mod=readonly -trimpath -tags "$TAGS" -ldflags "$LDFLAGS" \
    -o "$OUTDIR/$b" "k8s.io/kubernetes/cmd/$b"
  log "built $b in $(( $(date +%s) - start ))s ($(stat -c %s "$OUTDIR/$b") bytes)"
done

cp go.mod "$OUTDIR/wrapper.go.mod"
cp go.sum "$OUTDIR/wrapper.go.sum"
( cd "$OUTDIR" && sha256sum $BINARIES ) | tee "$OUTDIR/SHA256SUMS" >&2
