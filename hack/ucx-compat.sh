#!/usr/bin/env bash
# The agent's tests (unit, attack, push, pull, cancel, fuzz...) again on UCX 1.22 (hack/ucx-wheel.sh)
# instead of Debian's 1.13: the version a GPU node needs for CUDA memory (docs/operations.md).
set -euo pipefail
cd "$(dirname "$0")/.."
lib="$(hack/ucx-wheel.sh)"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" UCX_MODULE_DIR="$lib/ucx"
# As the chart runs agents: without UCX's memory hooks (tested as UCX loads, 0.4 s a process).
export UCX_MEM_EVENTS=n
# The tests check that they loaded it (transport::ucx::tests, PDPAIR_EXPECT_UCX).
PDPAIR_EXPECT_UCX=1.22 cargo test -q -p pdpair-agent "$@"
