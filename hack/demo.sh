#!/usr/bin/env bash
# make demo: the main job on a fresh machine. Installs what it needs, starts a local Kubernetes
# control plane and a real node (kubelet, containerd), builds pdpair's image and loads it, installs
# pdpair with Helm as a user would (default values: the operator and the agent run in pods),
# applies the examples, and runs a transfer between two engine pods through the agent pod.
# `make demo-down` stops it all.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO=${PDPAIR_DEMO_DIR:-/tmp/pdpair-demo}
bold() { printf '\n\033[1m%s\033[0m\n' "$*"; }
run() { printf '\033[2m$ %s\033[0m\n' "$*"; "$@"; }

bold "[1/8] Installing what the demo needs (the first run builds Kubernetes 1.20 from Debian's source, a node and pdpair's image: 20-30 minutes on 2 cores; later runs reuse the cache)"
hack/deps.sh
hack/node.sh build
HELM=$(hack/helm.sh)
echo "building pdpair's image (release binaries; cargo shows its progress on the first build)"
hack/images.sh

bold "[2/8] Starting a control plane and a node (etcd, apiserver, controller-manager, scheduler; kubelet, containerd, kube-proxy)"
hack/demo-down.sh >/dev/null 2>&1 || true
mkdir -p "$DEMO"
hack/node.sh up "$DEMO/cluster"
export KUBECONFIG=$DEMO/cluster/kubeconfig
run kubectl get nodes -o wide

bold "[3/8] helm install pdpair (default values: the operator's two replicas and the agent DaemonSet run in pods)"
run "$HELM" install pdpair charts/pdpair --namespace pdpair-system --create-namespace | sed -n '1,6p'
run kubectl -n pdpair-system rollout status deployment/pdpair-operator --timeout=180s
run kubectl -n pdpair-system rollout status daemonset/pdpair-agent --timeout=180s
run kubectl -n pdpair-system get pods -o wide

bold "[4/8] The vLLM mismatches are refused by kubectl apply (the webhook answers through its Service)"
echo "# push, prefill kernel block 16 / decode 64: vLLM stalls (requests pending after 150 s)"
run kubectl apply -f examples/vllm-push-16-64.yaml || true
echo "# FLASHINFER, prefill logical 128 / decode 64: vLLM's decode EngineCore crashes"
run kubectl apply -f examples/vllm-push-flashinfer-128-64.yaml || true
sleep 2
run kubectl get events --field-selector reason=Rejected -o custom-columns=TYPE:.type,REASON:.reason,OBJECT:.involvedObject.name,MESSAGE:.message

bold "[5/8] A compatible pair is admitted; the operator runs its engine pods (pdpair's test engine: no GPU here)"
run kubectl apply -f examples/test-engine-pair.yaml
run kubectl rollout status deployment/test-pair-prefill --timeout=180s
run kubectl rollout status deployment/test-pair-decode --timeout=180s
for _ in $(seq 1 120); do
  [[ $(kubectl get pdendpoints -o name | wc -l) -ge 2 ]] && break
  sleep 1
done
run kubectl get pods,pdendpoints -o wide

bold "[6/8] A transfer between the engine pods through the agent pod (push, FailClosed checksums, every byte checked)"
address=$(kubectl get pdendpoints -o jsonpath='{.items[?(@.spec.role=="prefill")].spec.address}')
run kubectl exec deploy/test-pair-decode -- pdpair-agent test-engine --prefill "$address"

bold "[7/8] The pair's status: Ready, with the transfer in its totals"
for _ in $(seq 1 60); do
  [[ $(kubectl get pdp test-pair -o jsonpath='{.status.transfer.transfersCompleted}') -ge 1 &&
     $(kubectl get pdp test-pair -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == True ]] && break
  sleep 1
done
run kubectl get pdp
run kubectl get pdp test-pair -o jsonpath='{range .status.conditions[*]}{.type}={.status} ({.reason}): {.message}{"\n"}{end}'
run kubectl get pdp test-pair -o jsonpath='endpoints={.status.transfer.endpoints} transfers={.status.transfer.transfersCompleted} bytes={.status.transfer.bytes}{"\n"}'

bold "[8/8] Left running (stop everything with: make demo-down)"
echo "  cluster: $DEMO/cluster (KUBECONFIG=$KUBECONFIG), node logs in $DEMO/cluster/node/logs"
echo "  Try: KUBECONFIG=$KUBECONFIG kubectl describe pdp test-pair"
