#!/usr/bin/env bash
# `make images`: pdpair's image built here without Docker or a registry. A Debian bookworm base
# made with debootstrap (cached), release binaries from cargo, images/Dockerfile built by buildah
# (vfs storage, chroot isolation, no pulls), written as an OCI archive a node imports
# (`ctr -n k8s.io images import`). Prints the archive's path.
#
#   hack/images.sh            build (cached base; image rebuilt when the binaries changed)
#   IMAGE=name:tag hack/images.sh
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${PDPAIR_CACHE:-/var/cache/pdpair}
IMAGES=$CACHE/images
IMAGE=${IMAGE:-ghcr.io/pdpair/pdpair:$(awk '/^appVersion:/{gsub(/"/,"",$2); print $2}' charts/pdpair/Chart.yaml)}
STORE=(--storage-driver vfs --root "$IMAGES/storage" --runroot "$IMAGES/run")
log() { echo "images: $*" >&2; }

# shellcheck source=hack/lib.sh
source hack/lib.sh

apt_install buildah debootstrap
mkdir -p "$IMAGES"

# The base: Debian bookworm, minbase, from the mirror this machine uses; an OCI archive.
base=$IMAGES/base-bookworm.tar
if [[ ! -s $base ]]; then
  log "debootstrap bookworm (about a minute, once)"
  root=$IMAGES/base-root
  rm -rf "$root"
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >"$IMAGES/debootstrap.log" 2>&1 \
    || { tail -20 "$IMAGES/debootstrap.log" >&2; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  ctr=$(buildah "${STORE[@]}" from scratch)
  buildah "${STORE[@]}" copy "$ctr" "$root" / >/dev/null
  buildah "${STORE[@]}" config --cmd /bin/bash "$ctr"
  buildah "${STORE[@]}" commit -q "$ctr" localhost/pdpair-base:bookworm >/dev/null
  buildah "${STORE[@]}" rm "$ctr" >/dev/null
  buildah "${STORE[@]}" push -q localhost/pdpair-base:bookworm "oci-archive:$base.tmp:localhost/pdpair-base:bookworm"
  mv "$base.tmp" "$base"
  rm -rf "$root"
fi
buildah "${STORE[@]}" images -q localhost/pdpair-base:bookworm >/dev/null 2>&1 \
  || buildah "${STORE[@]}" pull -q "oci-archive:$base" >/dev/null

log "cargo build --release (operator, agent)"
cargo build -q --release -p pdpair-operator -p pdpair-agent
ctx=$IMAGES/context
rm -rf "$ctx" && mkdir -p "$ctx/bin"
cp target/release/pdpair-operator target/release/pdpair-agent "$ctx/bin/"
# UCX 1.22 beside the system's 1.13 (the chart's agent.ucx.library picks): its libraries and the
# cma and cuda modules from PyPI's libucx-cu12 (hack/ucx-wheel.sh), with the CUDA runtime its
# memory hooks link; libcuda and NVML come from the node's driver.
hack/ucx-wheel.sh --copy "$ctx/ucx-1.22" >/dev/null

# Rebuild only when the binaries, UCX 1.22 or the Dockerfile changed.
stamp=$(find "$ctx" -type f | sort | xargs cat images/Dockerfile | sha256sum | cut -c1-16)
name=${IMAGE//[\/:]/_}
archive=$IMAGES/$name.tar
if [[ -s $archive && $(cat "$archive.stamp" 2>/dev/null) == "$stamp" ]]; then
  log "$IMAGE up to date: $archive"
  echo "$archive"
  exit 0
fi
log "buildah bud $IMAGE"
buildah "${STORE[@]}" bud -q --isolation chroot --pull-never --layers=false \
  --build-arg BASE=localhost/pdpair-base:bookworm -f images/Dockerfile -t "$IMAGE" "$ctx" >"$IMAGES/build.log" 2>&1 \
  || { tail -30 "$IMAGES/build.log" >&2; exit 1; }
rm -f "$archive"
buildah "${STORE[@]}" push -q "$IMAGE" "oci-archive:$archive:$IMAGE"
echo "$stamp" > "$archive.stamp"
# Keep the store small: only the base stays in it.
buildah "${STORE[@]}" rmi -f "$IMAGE" >/dev/null 2>&1 || true
log "$IMAGE: $archive ($(du -h "$archive" | cut -f1))"
echo "$archive"
