#!/usr/bin/env bash
# Builds the pdpair-vllm wheel with the ecosystem's tools (PEP 517 `build`) into
# target/python-wheel and installs it into the cached vLLM venv (hack/vllm-venv.sh) the way a user
# installs it; prints the venv's path.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(hack/vllm-venv.sh)"
out=target/python-wheel
rm -rf "$out" python/build python/src/*.egg-info
"$venv/bin/python" -m build -q --wheel --no-isolation --outdir "$out" python >/dev/null 2>&1 ||
  "$venv/bin/python" -m build --wheel --no-isolation --outdir "$out" python >&2
rm -rf python/build python/src/*.egg-info
"$venv/bin/pip" install -q --force-reinstall --no-deps "$out"/pdpair_vllm-*.whl >&2
echo "$venv"
