#!/usr/bin/env bash
# The connector's tests: the pdpair-vllm wheel built and installed into the cached vLLM venv
# (hack/python-wheel.sh), then python/tests against real agents (`pdpair-agent run`) and real
# vLLM. The tests import the installed package, not the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p pdpair-agent
venv="$(hack/python-wheel.sh)"
cd python/tests
PDPAIR_AGENT_BIN="$PWD/../../target/debug/pdpair-agent" "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not gpu" "$@" .
