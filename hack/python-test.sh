#!/usr/bin/env bash
# The connector's tests: builds the pdpair-vllm wheel with the ecosystem's tools (PEP 517 `build`),
# installs it into the cached vLLM venv (hack/vllm-venv.sh) the way a user installs it, and runs
# python/tests against real agents (`pdpair-agent run`) and real vLLM. The tests import the
# installed package, not the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(hack/vllm-venv.sh)"
cargo build -q -p pdpair-agent
out=target/python-wheel
rm -rf "$out" python/build python/src/*.egg-info
"$venv/bin/python" -m build -q --wheel --no-isolation --outdir "$out" python >/dev/null 2>&1 || "$venv/bin/python" -m build --wheel --no-isolation --outdir "$out" python
rm -rf python/build python/src/*.egg-info
"$venv/bin/pip" install -q --force-reinstall --no-deps "$out"/pdpair_vllm-*.whl
cd python/tests
PDPAIR_AGENT_BIN="$PWD/../../target/debug/pdpair-agent" "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" .
