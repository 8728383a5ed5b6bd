#!/usr/bin/env bash
# Benchmarks for docs/benchmarks.md: push throughput over shm and tcp beside ucx_perftest at the
# same message sizes and NIXL's UCX backend, handshake rejection latency, and the checksum's
# speed per core. Release build; every number printed comes with the command that produced it.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/lib.sh
source hack/lib.sh
hack/deps.sh
bench_setup

big() { bench_manifest "$tmp/8b.yaml" "$1"; }

run() { echo "\$ $*"; "$@"; echo; }

big Disabled
for t in shm tcp; do
  run $bin loopback --pair "$tmp/8b.yaml" --requests 6 --prompt-tokens 4096 --transport $t --no-verify-bytes -o json
done
# The same with pools the engines allocate (registered, not allocated by UCX: emulated puts on one host).
run $bin loopback --pair "$tmp/8b.yaml" --requests 6 --prompt-tokens 4096 --transport shm --no-verify-bytes --engine-memory engine -o json
big FailClosed
run $bin loopback --pair "$tmp/8b.yaml" --requests 6 --prompt-tokens 4096 --transport shm --no-verify-bytes -o json
# Many small blocks: scattered decode block ids, one 32 KiB WRITE per block and layer.
big Disabled
run $bin loopback --pair "$tmp/8b.yaml" --requests 6 --prompt-tokens 4096 --transport shm --no-verify-bytes --scatter-blocks -o json

# ucx_perftest's put bandwidth at the same sizes (8 MiB and 32 KiB), same machine, same run.
perf() { perftest_put "$@"; echo; }
perf posix,sysv,self 268435456 20 13336
# NIXL's UCX backend moving the same bytes (512 MiB in 8 MiB descriptors, 16 times) between two
# processes, beside the shm push and ucx_perftest above.
nixl=$(hack/nixl-venv.sh)
run env UCX_MODULES=^ib "$nixl/bin/python" hack/nixl-bench.py 512 8 16
perf posix,sysv,self 8388608 300 13337
perf tcp,self 8388608 100 13338
perf posix,sysv,self 32768 20000 13339

# Rejections: push 16/64 and FLASHINFER 128/64 beside a compatible prefill.
run $bin loopback --transport tcp --pair examples/vllm-push-64-64.yaml --also-prefill examples/vllm-push-16-64.yaml \
  --also-prefill examples/vllm-push-flashinfer-128-64.yaml --requests 300 --prompt-tokens 64 -o json

# The checksum on one core beside a plain read of the same bytes.
run $bin bench-checksum --mib 512

# Put bandwidth over shared memory into registered memory (engine files) and into memory UCX
# allocated (agent-allocated pools), one thread, same target sizes.
run $bin bench-put --mib 256 --rounds 5
# The same at the many-small-blocks size (32 KiB puts over 256 MiB of distinct memory).
run $bin bench-put --mib 256 --put-kib 32 --rounds 5

# Per-request cost through the vLLM connector beside the synthetic engines (the vLLM venv, once).
run hack/bench-connector.sh 12
