#!/usr/bin/env bash
# K and V side by side (vLLM 0.33's layout, `Interleaved`) beside K and V arrays, pushed over
# shared memory: both sides in arrays (the baseline), both side by side with layers outermost
# (vLLM's default: a layer's run of blocks moves whole, K and V together) and with blocks
# outermost (a block of a layer per op), and decode side by side against prefill's arrays (a
# piece per head's token),
# with ucx_perftest's put bandwidth at 8 MiB as the peer, interleaved in each round, since this
# machine's numbers drift between runs. Release build. Usage: hack/bench-side-by-side.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/lib.sh
source hack/lib.sh
hack/deps.sh
bench_setup
bench_manifest "$tmp/8b.yaml" Disabled
summary='import json,sys; r=json.load(sys.stdin); print({"gb_per_s": r["throughput_gb_per_s"], **{k: r["latency_ms"][k] for k in ("p50","p99")}, "succeeded": r["succeeded"]})'
for round in $(seq "${1:-3}"); do
  for sbs in "" "--side-by-side both" "--side-by-side both --blocks-outermost" "--side-by-side decode"; do
    echo "round $round: \$ $bin loopback --pair 8b.yaml --requests 8 --prompt-tokens 4096 --transport shm --no-verify-bytes $sbs -o json"
    # shellcheck disable=SC2086 # the flag and its value, word by word
    $bin loopback --pair "$tmp/8b.yaml" --requests 8 --prompt-tokens 4096 --transport shm --no-verify-bytes $sbs -o json | python3 -c "$summary"
  done
  perftest_put posix,sysv,self 8388608 300 $((13350 + round)) "round $round: "
done
