#!/usr/bin/env bash
# Fetches UCX 1.22 from PyPI's libucx-cu12 wheel (pinned; cma, posix, sysv, tcp and cuda modules,
# no verbs) once into a cache outside the tree and prints its lib directory. The agent is built
# against Debian's 1.13 headers and runs on either library (same soname, libucp.so.0).
set -euo pipefail
version=1.22.0
cache=/var/cache/pdpair/libucx-$version
lib="$cache/libucx/lib"
if [[ ! -e "$lib/libucp.so.0" ]]; then
  rm -rf "$cache.tmp" && mkdir -p "$cache.tmp"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$cache.tmp" "libucx-cu12==$version" >&2
  python3 -m zipfile -e "$cache.tmp"/libucx_cu12-"$version"-*.whl "$cache.tmp/x"
  chmod +x "$cache.tmp/x/libucx/bin/"* 2>/dev/null || true
  rm -rf "$cache" && mv "$cache.tmp/x" "$cache" && rm -rf "$cache.tmp"
fi
echo "$lib"
