#!/usr/bin/env bash
# The KV stream (`--transport tcp`) beside ucx_perftest's put bandwidth over UCX's tcp (the path
# it replaced) at the stream's write size, interleaved in rounds on one machine: 16 requests of a
# 4096-token prompt of an 8B-class model (512 MiB each, 64 coalesced writes of 8 MiB), the
# stream with one lane and with the agents' default lanes (--stream-lanes), then shared memory,
# and NIXL's UCX backend over tcp moving the same bytes between two processes (a peer moving KV
# over TCP, unencrypted; hack/nixl-venv.sh).
# Usage: hack/bench-stream.sh [rounds]; with PDPAIR_BENCH_BASELINE=<another pdpair-agent> each
# round also runs that binary's stream (a build of another commit) beside this one's.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/lib.sh
source hack/lib.sh
hack/deps.sh >/dev/null
bench_setup
nixl=$(hack/nixl-venv.sh)
bench_manifest "$tmp/8b.yaml"
summary='import json,sys; r=json.load(sys.stdin); print({k: r[k] for k in ("throughput_gb_per_s","p50_ms","p99_ms","paths") if k in r})'
for round in $(seq "${1:-3}"); do
  for t in "tcp --stream-lanes 1" tcp shm; do
    echo "round $round: \$ $bin loopback --pair 8b.yaml --requests 16 --prompt-tokens 4096 --transport $t --no-verify-bytes -o json"
    # shellcheck disable=SC2086 # the transport and its flags, word by word
    $bin loopback --pair "$tmp/8b.yaml" --requests 16 --prompt-tokens 4096 --transport $t --no-verify-bytes -o json | python3 -c "$summary"
  done
  if [[ -n ${PDPAIR_BENCH_BASELINE:-} ]]; then
    echo "round $round: baseline \$ $PDPAIR_BENCH_BASELINE loopback --pair 8b.yaml --requests 16 --prompt-tokens 4096 --transport tcp --no-verify-bytes -o json"
    "$PDPAIR_BENCH_BASELINE" loopback --pair "$tmp/8b.yaml" --requests 16 --prompt-tokens 4096 --transport tcp --no-verify-bytes -o json | python3 -c "$summary"
  fi
  echo "round $round: \$ UCX_MODULES=^ib UCX_TLS=tcp python3 hack/nixl-bench.py 512 8 16"
  env UCX_MODULES=^ib UCX_TLS=tcp "$nixl/bin/python" hack/nixl-bench.py 512 8 16 2>/dev/null | grep '^nixl'
  perftest_put tcp,self 8388608 200 $((13340 + round)) "round $round: "
done
