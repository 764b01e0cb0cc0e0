#!/usr/bin/env bash
# Starts the three processes in the foreground, anonymous on 127.0.0.1:8080,
# with state under $1 (default ./.run). Each line of output is prefixed with
# its process. Ctrl-C (or SIGTERM) stops all three.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
state=${1:-$root/.run}
bin=$root/bin
mkdir -p "$state/state/images"
export VM_MANAGER_STATE_DIR=${VM_MANAGER_STATE_DIR:-$state/state}
export VM_MANAGER_RUN_DIR=${VM_MANAGER_RUN_DIR:-$state/run}
export VM_MANAGER_LISTEN=${VM_MANAGER_LISTEN:-127.0.0.1:8080}
export VM_MANAGER_METRICS_ENABLED=${VM_MANAGER_METRICS_ENABLED:-true}

pids=()
stop() {
  trap - INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait
}
trap stop INT TERM

start() {
  local name=$1; shift
  # The process substitution keeps $! the service's own PID.
  "$@" > >(sed -u "s/^/[$name] /") 2>&1 &
  pids+=($!)
}

start attestation "$bin/vmm-attestation" serve
start hypervisor  "$bin/vmm-hypervisor" serve
start gateway     "$bin/vmm-gateway" serve
echo "[run] state $VM_MANAGER_STATE_DIR, sockets $VM_MANAGER_RUN_DIR, API http://$VM_MANAGER_LISTEN (Ctrl-C stops)" >&2
# Any process ending takes the others down with it.
wait -n || true
stop
