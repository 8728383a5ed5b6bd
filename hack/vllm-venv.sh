#!/usr/bin/env bash
# Builds (once) the Python environment the connector tests run in: vLLM 0.33.0 from PyPI (with the
# torch and nvidia wheels it pulls, about 5 GB) plus the build tools for the pdpair-vllm wheel.
# Cached outside the work tree; prints the venv's path. No GPU is needed: vLLM's scheduler and
# connector factory import and run on CPU (docs/vllm.md).
set -euo pipefail
VLLM_VERSION=0.33.0
dir="${PDPAIR_VLLM_VENV:-/var/cache/pdpair/vllm-$VLLM_VERSION}"
stamp="$dir/.complete"
if [[ ! -f "$stamp" ]]; then
  echo "hack/vllm-venv.sh: building $dir (vllm==$VLLM_VERSION, a few GB, once)" >&2
  rm -rf "$dir"
  mkdir -p "$(dirname "$dir")"
  python3 -m venv "$dir"
  "$dir/bin/pip" install -q --upgrade pip >&2
  "$dir/bin/pip" install -q "vllm==$VLLM_VERSION" build pytest >&2
  touch "$stamp"
fi
echo "$dir"
