#!/usr/bin/env bash
# Builds (once) a Python environment with NIXL's wheel (nixl-cu12, its bundled UCX 1.23; no GPU
# needed) and numpy, for hack/nixl-bench.py. The wheel declares torch, which the benchmark's
# DRAM path never imports, so it is installed without its dependencies (about 90 MB instead of
# 5 GB). Cached outside the work tree; prints the venv's path.
set -euo pipefail
NIXL_VERSION=1.5.1
dir="${PDPAIR_NIXL_VENV:-/var/cache/pdpair/nixl-$NIXL_VERSION}"
stamp="$dir/.complete"
if [[ ! -f "$stamp" ]]; then
  echo "hack/nixl-venv.sh: building $dir (nixl-cu12==$NIXL_VERSION, once)" >&2
  rm -rf "$dir"
  mkdir -p "$(dirname "$dir")"
  python3 -m venv "$dir"
  "$dir/bin/pip" install -q numpy >&2
  "$dir/bin/pip" install -q --no-deps "nixl-cu12==$NIXL_VERSION" >&2
  touch "$stamp"
fi
echo "$dir"
