#!/usr/bin/env bash
# Fetches UCX 1.22 from PyPI's libucx-cu12 wheel (pinned by version and hash; cma, posix, sysv, tcp
# and cuda modules, no verbs) once into a cache outside the tree and prints its lib directory. The
# agent is built against Debian's 1.13 headers and runs on either library (same soname,
# libucp.so.0). Concurrent callers (images and ucx-compat) wait for each other.
#
#   hack/ucx-wheel.sh            print the lib directory
#   hack/ucx-wheel.sh --copy D   also copy what the agent loads into D: D/lib (libucp, libuct, libucs,
#                                libucm, the CUDA runtime ucm_cuda links) and D/lib/ucx (cma, cuda)
set -euo pipefail
version=1.22.0
sha256=5cbbef0c140a0a158ae3486089af659b38822b2234cd3dc90ba40a5e6553402a
cache=${PDPAIR_CACHE:-/var/cache/pdpair}/libucx-$version
lib="$cache/libucx/lib"
mkdir -p "$(dirname "$cache")"
exec 9>"$cache.lock"
flock 9
if [[ ! -e "$lib/libucp.so.0" ]]; then
  rm -rf "$cache.tmp" && mkdir -p "$cache.tmp"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$cache.tmp" "libucx-cu12==$version" >&2
  wheel=$(echo "$cache.tmp"/libucx_cu12-"$version"-*.whl)
  echo "$sha256  $wheel" | sha256sum -c --quiet - >&2 ||
    { echo "hack/ucx-wheel.sh: $wheel is not the wheel pinned here (sha256 $sha256)" >&2; exit 1; }
  python3 -m zipfile -e "$wheel" "$cache.tmp/x"
  chmod +x "$cache.tmp/x/libucx/bin/"* 2>/dev/null || true
  rm -rf "$cache" && mv "$cache.tmp/x" "$cache" && rm -rf "$cache.tmp"
fi
if [[ ${1:-} == --copy ]]; then
  dest=$2
  mkdir -p "$dest/lib/ucx"
  for f in libucp libuct libucs libucm; do cp -L "$lib/$f.so.0" "$dest/lib/"; done
  cp "$cache"/libucx_cu12.libs/libcudart-*.so.* "$dest/lib/"
  for m in libuct_cma libuct_cuda libucm_cuda; do cp -L "$lib/ucx/$m.so.0" "$dest/lib/ucx/"; done
fi
echo "$lib"
