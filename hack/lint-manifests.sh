#!/usr/bin/env bash
# Lints the example PDPairs with the rule table, the way `kubectl apply` will once the
# admission webhook runs. The vLLM cases show what vLLM does today and what pdpair says instead.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build -q -p pdpair-operator
bin=target/debug/pdpair-operator

for f in examples/*.yaml; do
  echo "== $f"
  grep '^#' "$f" | sed 's/^# \{0,1\}/   /'
  set +e
  "$bin" validate "$f"
  rc=$?
  set -e
  echo "   (exit $rc)"
  echo
done

echo "== the node agents: real agent processes, sockets and UCX on loopback"
echo "   decode from vllm-push-64-64 with three prefills: its own (compatible), the 16-token one,"
echo "   and the FLASHINFER 128/64 one. vLLM would stall or crash; the agents refuse at the handshake"
echo "   and decode keeps serving the compatible prefill."
cargo build -q -p pdpair-agent
target/debug/pdpair-agent loopback --pair examples/vllm-push-64-64.yaml \
  --also-prefill examples/vllm-push-16-64.yaml --also-prefill examples/vllm-push-flashinfer-128-64.yaml \
  --requests 9 --prompt-tokens 256
echo
tmp=$(mktemp -d)
# FailClosed whatever the example says (it says so now; a second checksum key failed to parse).
sed '/^    checksum:/d; s/mode: Push/mode: Push\n    checksum: FailClosed/' examples/vllm-push-64-64.yaml > "$tmp/failclosed.yaml"
echo "   the 64/64 pair with FailClosed checksums, over shared memory, every byte checked by decode:"
target/debug/pdpair-agent loopback --pair "$tmp/failclosed.yaml" --requests 4 --prompt-tokens 256 --transport shm
echo
echo "   the same with one byte flipped in flight per request: every request fails, none is accepted:"
target/debug/pdpair-agent loopback --pair "$tmp/failclosed.yaml" --requests 4 --prompt-tokens 256 --transport shm --corrupt-one-byte
rm -rf "$tmp"
