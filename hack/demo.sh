#!/usr/bin/env bash
# make demo: the main job on a fresh machine. Installs what it needs, starts a local Kubernetes
# control plane, installs pdpair with Helm, runs the operator (out of cluster, behind the chart's
# webhook.url) and two node agents on loopback, applies the examples, and shows what happens.
# Everything it starts is listed at the end; `make demo-down` stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO=${PDPAIR_DEMO_DIR:-/tmp/pdpair-demo}
PORT=${PDPAIR_DEMO_PORT:-19443}
bold() { printf '\n\033[1m%s\033[0m\n' "$*"; }
run() { printf '\033[2m$ %s\033[0m\n' "$*"; "$@"; }

bold "[1/8] Installing what the demo needs (the first run builds Kubernetes 1.20 from Debian's source: several minutes; later runs reuse the cache)"
hack/deps.sh
hack/control-plane.sh build
HELM=$(hack/helm.sh)
echo "building pdpair (cargo shows its progress)"
cargo build -p pdpair-operator -p pdpair-agent

bold "[2/8] Starting a local control plane (etcd, kube-apiserver, controller-manager, scheduler; no kubelet)"
hack/demo-down.sh >/dev/null 2>&1 || true
mkdir -p "$DEMO"
hack/control-plane.sh start "$DEMO/cp"
export KUBECONFIG=$DEMO/cp/kubeconfig

bold "[3/8] helm install pdpair (webhook.url points the API server at the operator on this machine)"
run "$HELM" install pdpair charts/pdpair --namespace pdpair-system --create-namespace --set "webhook.url=https://127.0.0.1:$PORT" | sed -n '1,6p'
kubectl -n pdpair-system get secret pdpair-webhook-tls -o jsonpath='{.data.tls\.crt}' | base64 -d > "$DEMO/tls.crt"
kubectl -n pdpair-system get secret pdpair-webhook-tls -o jsonpath='{.data.tls\.key}' | base64 -d > "$DEMO/tls.key"

bold "[4/8] Running the operator with the chart's certificate, and two node agents"
# The demo's engines are local processes, not in Pods: the agents run with --no-attest (and say
# so in their logs); in a cluster each engine is bound to the Pod it names.
nohup target/debug/pdpair-operator run --kubeconfig "$KUBECONFIG" --tls-cert "$DEMO/tls.crt" --tls-key "$DEMO/tls.key" \
  --webhook-bind "127.0.0.1:$PORT" --admin-bind 127.0.0.1:18080 --lease-namespace pdpair-system --identity demo \
  > "$DEMO/operator.log" 2>&1 &
echo "operator $!" > "$DEMO/pids"
for node in node-a node-b; do
  nohup target/debug/pdpair-agent run --name "$node" --socket "$DEMO/$node.sock" --listen-host 127.0.0.1 \
    --transport shm --pool-dir "$DEMO/pools" --kubeconfig "$KUBECONFIG" \
    --no-attest > "$DEMO/agent-$node.log" 2>&1 &
  echo "agent-$node $!" >> "$DEMO/pids"
done
for _ in $(seq 1 100); do curl -sf 127.0.0.1:18080/readyz >/dev/null && break; sleep 0.2; done
echo "operator ready: $(curl -s 127.0.0.1:18080/readyz)"

bold "[5/8] The vLLM mismatches are refused by kubectl apply"
echo "# push, prefill kernel block 16 / decode 64: vLLM stalls (requests pending after 150 s)"
run kubectl apply -f examples/vllm-push-16-64.yaml || true
echo "# FLASHINFER, prefill logical 128 / decode 64: vLLM's decode EngineCore crashes"
run kubectl apply -f examples/vllm-push-flashinfer-128-64.yaml || true
sleep 1
run kubectl get events --field-selector reason=Rejected -o custom-columns=TYPE:.type,REASON:.reason,OBJECT:.involvedObject.name,MESSAGE:.message

bold "[6/8] A compatible pair is admitted"
run kubectl apply -f examples/vllm-push-64-64.yaml
sleep 2
run kubectl get pdp
run kubectl get pdp vllm-push-64-64 -o jsonpath='{range .status.conditions[*]}{.type}={.status} ({.reason}): {.message}{"\n"}{end}'

bold "[7/8] A push transfer between the two agents (synthetic engines, FailClosed checksums, shared memory)"
for pod in decode-0:decode prefill-0:prefill; do
  name=${pod%%:*}; role=${pod##*:}
  kubectl apply -f - >/dev/null <<POD
apiVersion: v1
kind: Pod
metadata: {name: $name, labels: {pdpair.dev/name: vllm-push-64-64, pdpair.dev/role: $role}}
spec: {containers: [{name: engine, image: vllm/vllm-openai:v0.11.0}]}
POD
done
kubectl get secret vllm-push-64-64-pairing -o jsonpath='{.data.key}' | base64 -d > "$DEMO/pairing.key"
run target/debug/pdpair-agent loopback --pair examples/vllm-push-64-64.yaml --requests 6 --prompt-tokens 512 \
  --transport shm --decode-agent "$DEMO/node-a.sock" --prefill-agent "$DEMO/node-b.sock" \
  --pairing-key-file "$DEMO/pairing.key" --decode-pod decode-0 --prefill-pod prefill-0
# The agents publish at most once a second and the operator folds their reports into the pair.
for _ in $(seq 1 40); do
  [[ $(kubectl get pdp vllm-push-64-64 -o jsonpath='{.status.transfer.checksumsVerified}') == 6 ]] && break
  sleep 0.5
done
run kubectl get pdendpoints
run kubectl get pdp vllm-push-64-64 -o jsonpath='endpoints={.status.transfer.endpoints} transfers={.status.transfer.transfersCompleted} bytes={.status.transfer.bytes} verified={.status.transfer.checksumsVerified}{"\n"}'

bold "[8/8] Left running (stop everything with: make demo-down)"
echo "  control plane: $DEMO/cp (KUBECONFIG=$KUBECONFIG)"
while read -r name pid; do echo "  $name: pid $pid, log $DEMO/$name.log"; done < "$DEMO/pids"
echo "  Try: KUBECONFIG=$KUBECONFIG kubectl describe pdp vllm-push-64-64"
