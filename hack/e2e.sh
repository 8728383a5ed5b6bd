#!/usr/bin/env bash
# End-to-end tests: a fresh control plane, then each e2e test binary in turn, stopping every
# operator the harness started between binaries. On failure the logs are printed and kept.
set -euo pipefail
cd "$(dirname "$0")/.."

hack/control-plane.sh build
HELM=$(hack/helm.sh)
export HELM
dir=$(mktemp -d "${TMPDIR:-/tmp}/pdpair-e2e.XXXXXX")
export PDPAIR_E2E_DIR=$dir

stop_operators() {
  [[ -f $dir/operator-pids ]] || return 0
  while read -r pid; do
    if [[ -r /proc/$pid/cmdline && $(tr '\0' ' ' < "/proc/$pid/cmdline") == *"pdpair-operator run"* ]]; then
      kill "$pid" 2>/dev/null || true
    fi
  done < "$dir/operator-pids"
  sleep 1
  rm -f "$dir/operator-pids"
}

ok=0
finish() {
  stop_operators
  hack/control-plane.sh stop "$dir" || true
  if ((ok)); then
    rm -rf "$dir"
  else
    for f in "$dir"/operator-*.log "$dir"/logs/kube-apiserver.log; do
      [[ -f $f ]] && { echo "---- tail of $f"; tail -40 "$f"; }
    done
    echo "e2e: logs kept in $dir" >&2
  fi
}
trap finish EXIT

hack/control-plane.sh start "$dir"
cargo build -p pdpair-operator -p pdpair-agent
cargo test -p pdpair-e2e --test chart
for t in operator agent attest helm operator_restart; do
  cargo test -p pdpair-e2e --test "$t"
  stop_operators
done
ok=1
