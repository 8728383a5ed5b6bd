#!/usr/bin/env bash
# Builds what `make gpu-check` runs on a GPU machine, here, without CUDA (cudarc loads libcuda and
# libnvrtc at run time): the release agent and the GPU test binary, into .gpu/ (ignored by git),
# with the script that runs them. Carry .gpu/ to the GPU machine; nothing is built there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu
rm -rf "$out"
mkdir -p "$out"
cargo build --release -p pdpair-agent
cp target/release/pdpair-agent "$out/pdpair-agent"
exe=$(cargo test --release -p pdpair-agent --test gpu --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
cp "$exe" "$out/gpu-tests"
cp hack/gpu-check.sh "$out/gpu-check.sh"
# What it was built from, printed first in the GPU machine's report: a bundle older than the tree
# it is carried with says so there.
{ echo "bundle: built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
    "$(git status --porcelain 2>/dev/null | grep -q . && echo '(with uncommitted changes)')"; } >"$out/VERSION"
# The UCX the agent was built and tested against (Debian's 1.13), so the GPU machine runs the
# agent as CI does whatever UCX it has (the one measured had 1.16): the libraries, libnuma, and
# the one transport module without further dependencies (cma; tcp and shared memory are built in).
lib=/usr/lib/x86_64-linux-gnu
mkdir -p "$out/lib/ucx"
for l in libucp.so.0 libuct.so.0 libucs.so.0 libucm.so.0 libnuma.so.1; do
  cp -L "$lib/$l" "$out/lib/$l"
done
cp -L "$lib/ucx/libuct_cma.so.0" "$out/lib/ucx/libuct_cma.so.0"
# UCX 1.22 as the image carries it (agent.ucx.library=1.22), with its ucx_info: the GPU machine
# says whether its CUDA module loads there and which memory types it then offers.
ucx=$(hack/ucx-wheel.sh --copy "$out/ucx-1.22")
mkdir -p "$out/ucx-1.22/bin"
cp "$ucx/../bin/ucx_info" "$out/ucx-1.22/bin/"
echo "gpu-bundle: $(du -sh "$out" | cut -f1) in $out: run $out/gpu-check.sh on the GPU machine"
