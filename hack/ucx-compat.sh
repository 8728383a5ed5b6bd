#!/usr/bin/env bash
# The agent's tests (unit, attack, push, pull, cancel, fuzz...) again on UCX 1.22 (hack/ucx-wheel.sh)
# instead of Debian's 1.13: the version a GPU node needs for CUDA memory (docs/operations.md).
set -euo pipefail
cd "$(dirname "$0")/.."
lib="$(hack/ucx-wheel.sh)"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" UCX_MODULE_DIR="$lib/ucx"
got="$("$lib/../bin/ucx_info" -v | sed -n 's/^# Library version: //p')"
[[ "$got" == 1.22.* ]] || { echo "hack/ucx-compat.sh: expected UCX 1.22, loaded '$got'" >&2; exit 1; }
PDPAIR_EXPECT_UCX=1.22 cargo test -q -p pdpair-agent "$@"
