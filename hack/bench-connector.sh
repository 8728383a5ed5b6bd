#!/usr/bin/env bash
# Per-request cost through the vLLM connector (python/tests/bench_connector.py: two vLLM
# schedulers with PdpairConnector, host staging both sides) beside the same requests between the
# agent's own synthetic engines (`pdpair-agent loopback`), in the same run: 8B-class geometry,
# 16-token blocks, shm, 512 and 4096 tokens, checksums Disabled and FailClosed; then vLLM 0.33's
# own KV tensors staged into host pools of each arrangement. docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/lib.sh
source hack/lib.sh
venv="$(hack/python-wheel.sh)"
bench_setup
requests="${1:-12}"
for checksum in Disabled FailClosed; do
  bench_manifest "$tmp/8b-$checksum.yaml" "$checksum" float16 NHD
  for tokens in 512 4096; do
    echo "synthetic engines, $tokens tokens, $checksum:"
    "$bin" loopback --pair "$tmp/8b-$checksum.yaml" --requests "$requests" --prompt-tokens "$tokens" \
      --transport shm --no-verify-bytes -o json |
      "$venv/bin/python" -c 'import json,sys; r=json.load(sys.stdin); print(" ", {k: r["latency_ms"][k] for k in ("p50","p99")}, "succeeded", r["succeeded"])'
  done
done
for tokens in 512 4096; do
  echo "synthetic engines, one region per layer, $tokens tokens, Disabled:"
  "$bin" loopback --pair "$tmp/8b-Disabled.yaml" --requests "$requests" --prompt-tokens "$tokens" \
    --transport shm --no-verify-bytes --region-per-layer -o json |
    "$venv/bin/python" -c 'import json,sys; r=json.load(sys.stdin); print(" ", {k: r["latency_ms"][k] for k in ("p50","p99")}, "succeeded", r["succeeded"], "regions", r["decode_regions"])'
done
echo "through the connector (vLLM schedulers, staging copies):"
cd python/tests
PDPAIR_AGENT_BIN="$bin" "$venv/bin/python" bench_connector.py "$requests" 2> >(grep -v -e "^W1201" -e WARNING -e Warning -e "^Turning" -e "^Initializing" -e "^FlashInfer" -e "^Failed to import" >&2)
echo "vLLM 0.33's KV tensors staged: host pools side by side, in K and V arrays, one of each (3 rounds):"
PDPAIR_AGENT_BIN="$bin" "$venv/bin/python" bench_connector.py 8 host-pools 3 2> >(grep -v -e "^W1201" -e WARNING -e Warning -e "^Turning" -e "^Initializing" -e "^FlashInfer" -e "^Failed to import" >&2)
