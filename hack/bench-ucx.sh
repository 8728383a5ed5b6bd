#!/usr/bin/env bash
# docs/benchmarks.md, "UCX 1.13 beside 1.22": the push over shm and tcp (512 MiB requests) and
# ucx_perftest at 256 MiB, on Debian's UCX 1.13 and on 1.22 (hack/ucx-wheel.sh), in three
# interleaved rounds (this machine drifts between runs). Release build.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/lib.sh
source hack/lib.sh
bench_setup
L=$(hack/ucx-wheel.sh)
bench_manifest "$tmp/8b.yaml"
with() { if [ "$1" = 1.22 ]; then shift; LD_LIBRARY_PATH=$L UCX_MODULE_DIR=$L/ucx "$@"; else shift; "$@"; fi; }
pt() { if [ "$1" = 1.22 ]; then perftest=(env "LD_LIBRARY_PATH=$L" "UCX_MODULE_DIR=$L/ucx" "$L/../bin/ucx_perftest"); else perftest=(ucx_perftest); fi; }
for round in 1 2 3; do
  for v in 1.13 1.22; do
    for t in shm tcp; do
      n=6; [ $t = tcp ] && n=4
      echo "round $round UCX $v $t: $(with $v $bin loopback --pair $tmp/8b.yaml --requests $n --prompt-tokens 4096 --transport $t --no-verify-bytes -o json | python3 -c 'import json,sys; r=json.load(sys.stdin); print({k:v for k,v in r.items() if k in ("throughput_gb_per_s","p50_ms","p99_ms","ucx_version","path")})')"
    done
    pt $v
    perftest_put posix,sysv,self 268435456 20 $((13400 + round * 2 + ${v#1.})) "round $round UCX $v perftest shm 256MiB: "
  done
done
