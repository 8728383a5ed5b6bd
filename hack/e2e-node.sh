#!/usr/bin/env bash
# The in-cluster end-to-end test: a control plane and a real node (hack/node.sh), pdpair's image
# built here (hack/images.sh) and imported into the node, then tests/e2e/node.rs (helm install,
# pods, a transfer between engine pods, failover, uninstall). Logs are kept on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

hack/node.sh build
hack/images.sh >/dev/null
HELM=$(hack/helm.sh)
export HELM
dir=$(mktemp -d "${TMPDIR:-/tmp}/pdpair-node.XXXXXX")
export PDPAIR_E2E_DIR=$dir
ok=0
finish() {
  if ((!ok)); then
    for f in "$dir"/node/logs/kubelet.log "$dir"/logs/kube-apiserver.log; do
      [[ -f $f ]] && { echo "---- tail of $f"; tail -30 "$f"; }
    done
    [[ -f $dir/kubeconfig ]] && KUBECONFIG=$dir/kubeconfig kubectl get pods -A -o wide 2>&1 | tail -20
    cp -r "$dir/node/logs" "${dir}-logs" 2>/dev/null && echo "e2e-node: logs kept in ${dir}-logs" >&2
  fi
  hack/node.sh stop "$dir" || true
  rm -rf "$dir"
}
trap finish EXIT
hack/node.sh up "$dir"
cargo test -p pdpair-e2e --test node
ok=1
